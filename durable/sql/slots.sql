-- durable_acquire_slot, durable_release_slot, durable_slot_hand_off,
-- durable_slots_held: a step-level quota's slot taken, or its release, its
-- hand-off and the wake-up of the runs handed a slot, in one round trip each
-- (PostgreSQL). Installed by migration 0023; a change here needs a new file in
-- durable/sql/migrations/ and a migration that runs it. They do what
-- durable/stores/slots.py (acquire, release, _hand_off, _held) and Executor.resume do through
-- the ORM on other databases; p_now comes from the caller, as the ORM path takes
-- it from the application's clock, and the statuses from durable.status
-- (p_active: the statuses of a run whose held slot counts; p_terminal: those of
-- a run whose waiting row is dropped).
--
-- Every write that can change a key's count of slots happens under the lock of
-- the key's durable_concurrencylock row, the row run admission locks. One key is
-- locked per call, and only then run rows (the step's own run, the runs woken):
-- a key's row before a run's, as every locker of durable takes them, so these
-- never deadlock with admission, hand-offs or each other.

-- durable_slot_hand_off: give the free slots of p_key to its waiting steps, oldest
-- first; the caller holds the key's row lock (p_override: its limit_override).
-- Returns woken, the run ids given a slot in that order; held, the key's slots in
-- use after that (NULL when no waiting step needed the count: the caller counts
-- if it must, durable_slots_held); waiting, whether steps still wait. A waiting
-- row whose run ended is deleted. The count of held slots is made once: under the key's lock nothing
-- else takes a slot, and a slot freed meanwhile (a journal write, a cancel) is
-- handed on by the release that follows it. A held row counts while its run is
-- active and its step is not journaled ('completed' or 'failed').
CREATE OR REPLACE FUNCTION durable_slot_hand_off(
    p_key text,
    p_override integer,
    p_now timestamp with time zone,
    p_active text[],
    p_terminal text[],
    OUT woken text[],
    OUT held bigint,
    OUT waiting boolean
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id bigint;
    v_limit integer;
    v_status text;
    v_run_id text;
BEGIN
    woken := '{}';
    waiting := false;
    LOOP
        SELECT s.id, s."limit", r.status, r.run_id INTO v_id, v_limit, v_status, v_run_id
          FROM durable_stepslot s JOIN durable_workflowrun r ON r.id = s.run_id
         WHERE s.key = p_key AND s.status = 'waiting'
         ORDER BY s.id LIMIT 1;
        EXIT WHEN NOT FOUND;
        IF v_status = ANY (p_terminal) THEN
            DELETE FROM durable_stepslot s WHERE s.id = v_id;
            CONTINUE;
        END IF;
        IF held IS NULL THEN
            held := durable_slots_held(p_key, p_active);
        END IF;
        IF held >= COALESCE(p_override, v_limit) THEN
            waiting := true;
            EXIT;
        END IF;
        UPDATE durable_stepslot s SET status = 'held', lease = '', granted_at = p_now WHERE s.id = v_id;
        held := held + 1;
        woken := woken || v_run_id;
    END LOOP;
END;
$$;

-- durable_slots_held: the slots of p_key in use: held rows whose run is active
-- (p_active) and whose step is not journaled.
CREATE OR REPLACE FUNCTION durable_slots_held(p_key text, p_active text[]) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*)
      FROM durable_stepslot s JOIN durable_workflowrun r ON r.id = s.run_id
     WHERE s.key = p_key AND s.status = 'held' AND r.status = ANY (p_active)
       AND NOT EXISTS (
           SELECT 1 FROM durable_steprecord j
            WHERE j.run_id = s.run_id AND j.position = s.position AND j.outcome IN ('completed', 'failed'));
$$;

-- durable_acquire_slot: the step at p_position of run p_run_id, running under
-- p_lease, asks for a slot of p_key (p_limit: the step's limit; an operator's
-- override on the key's row replaces it). First, without the key's lock, the slot
-- handed to the step while its run was parked is taken up (its lease set: the
-- key's count does not change). Else, under the key's row lock (the row created
-- first, with p_limit and no count_statuses, when missing) and the run's: the
-- step's own row found again is its slot when held with no lease or this one;
-- any other (a dead execution's slot, a waiting row of a run woken otherwise) is
-- deleted and the step asks again behind the waiters. The key's free slots go to
-- its waiters first (durable_slot_hand_off); the step gets one only when none
-- waits. Else it is refused (not p_queue, or a limit of 0 or less) or parks: a
-- waiting row, and the run 'suspended' (waiting for 'slot:' || p_key, no lease)
-- with its tags, its attempt taken back (this claim's, not an earlier death's).
-- Returns {"outcome": "held" | "waiting" | "full" | "lost" (the run is no longer
-- the lease's), "active" (the key's held slots counted, 0 when the step's own slot
-- was found again), "limit" (in effect), "woken" (run ids handed a slot, to wake)}.
CREATE OR REPLACE FUNCTION durable_acquire_slot(
    p_run_id text,
    p_lease text,
    p_position integer,
    p_key text,
    p_limit integer,
    p_queue boolean,
    p_now timestamp with time zone,
    p_active text[],
    p_terminal text[]
) RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_override integer;
    v_in_effect integer;
    v_pk bigint;
    v_id bigint;
    v_row_key text;
    v_row_status text;
    v_row_lease text;
    v_hand record;
    v_held bigint;
BEGIN
    UPDATE durable_stepslot s SET lease = p_lease FROM durable_workflowrun r
     WHERE r.id = s.run_id AND r.run_id = p_run_id AND r.status = 'running' AND r.lease = p_lease
       AND s.position = p_position AND s.key = p_key AND s.status = 'held' AND s.lease IN ('', p_lease);
    IF FOUND THEN
        RETURN jsonb_build_object('outcome', 'held', 'active', 0, 'limit', p_limit, 'woken', '[]'::jsonb);
    END IF;
    SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        -- No count_statuses: no run is counted under this key unless a start says so.
        -- ON CONFLICT DO NOTHING waits for a concurrent insert of the key.
        INSERT INTO durable_concurrencylock (key, "limit", count_statuses, rr_cursor)
        VALUES (p_key, p_limit, '[]'::jsonb, '') ON CONFLICT (key) DO NOTHING;
        SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_key FOR UPDATE;
    END IF;
    v_in_effect := COALESCE(v_override, p_limit);
    SELECT r.id INTO v_pk FROM durable_workflowrun r
     WHERE r.run_id = p_run_id AND r.status = 'running' AND r.lease = p_lease FOR UPDATE;
    IF NOT FOUND THEN
        RETURN jsonb_build_object('outcome', 'lost', 'active', 0, 'limit', 0, 'woken', '[]'::jsonb);
    END IF;
    SELECT s.id, s.key, s.status, s.lease INTO v_id, v_row_key, v_row_status, v_row_lease
      FROM durable_stepslot s WHERE s.run_id = v_pk AND s.position = p_position;
    IF FOUND THEN
        IF v_row_key = p_key AND v_row_status = 'held' AND v_row_lease IN ('', p_lease) THEN
            IF v_row_lease <> p_lease THEN
                UPDATE durable_stepslot s SET lease = p_lease WHERE s.id = v_id;
            END IF;
            RETURN jsonb_build_object('outcome', 'held', 'active', 0, 'limit', v_in_effect, 'woken', '[]'::jsonb);
        END IF;
        DELETE FROM durable_stepslot s WHERE s.id = v_id;
    END IF;
    SELECT * INTO v_hand FROM durable_slot_hand_off(p_key, v_override, p_now, p_active, p_terminal);
    v_held := COALESCE(v_hand.held, durable_slots_held(p_key, p_active));
    IF v_in_effect > 0 AND v_held < v_in_effect AND NOT v_hand.waiting THEN
        INSERT INTO durable_stepslot (key, run_id, position, status, "limit", lease, granted_at)
        VALUES (p_key, v_pk, p_position, 'held', p_limit, p_lease, p_now);
        RETURN jsonb_build_object('outcome', 'held', 'active', v_held + 1, 'limit', v_in_effect,
                                  'woken', to_jsonb(v_hand.woken));
    END IF;
    IF NOT p_queue OR v_in_effect <= 0 THEN
        RETURN jsonb_build_object('outcome', 'full', 'active', v_held, 'limit', v_in_effect,
                                  'woken', to_jsonb(v_hand.woken));
    END IF;
    INSERT INTO durable_stepslot (key, run_id, position, status, "limit", lease)
    VALUES (p_key, v_pk, p_position, 'waiting', p_limit, '');
    UPDATE durable_workflowrun r
       SET status = 'suspended', updated_at = p_now, waiting_for = 'slot:' || p_key, wake_at = NULL, lease = '',
           attempt = GREATEST(r.attempt - 1, 0)
     WHERE r.id = v_pk;
    UPDATE durable_runtag t SET status = 'suspended' WHERE t.run_id = v_pk;
    RETURN jsonb_build_object('outcome', 'waiting', 'active', v_held, 'limit', v_in_effect,
                              'woken', to_jsonb(v_hand.woken));
END;
$$;

-- durable_release_slot: the step at p_position of run p_run_id ended (journaled, or
-- stopped): lock p_key's row, delete the step's held row of lease p_lease, and
-- hand the key's free slots on (durable_slot_hand_off). With p_wake, the runs
-- given a slot are woken too, still under the key's lock: each one parked for it
-- (suspended, waiting for 'slot:' || p_key) moves back to 'pending' with its
-- tags, as Executor.resume does on the ORM path after the commit; one woken or
-- cancelled meanwhile is left alone. A run holding a run-level key that does not
-- count 'suspended' (the key's row has a limit and count_statuses without it) is
-- only named: coming back must count that key again under its lock, which the
-- caller's resume does. A key without a row (never created) is not locked, as on
-- the ORM path. Returns {"started": [the runs made pending, each a row of
-- durable_workflowrun with "parent_run_id", for the caller to send], "wake":
-- [run ids given a slot, for the caller to wake]}; both empty when the step's
-- row is gone already (a takeover freed it).
CREATE OR REPLACE FUNCTION durable_release_slot(
    p_run_id text,
    p_position integer,
    p_key text,
    p_lease text,
    p_now timestamp with time zone,
    p_active text[],
    p_terminal text[],
    p_wake boolean
) RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_override integer;
    v_woken text;
    v_run durable_workflowrun;
    v_started jsonb := '[]'::jsonb;
    v_wake text[] := '{}';
BEGIN
    SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_key FOR UPDATE;
    DELETE FROM durable_stepslot s USING durable_workflowrun r
     WHERE r.id = s.run_id AND r.run_id = p_run_id AND s.position = p_position
       AND s.key = p_key AND s.lease = p_lease AND s.status = 'held';
    IF NOT FOUND THEN
        RETURN jsonb_build_object('started', v_started, 'wake', to_jsonb(v_wake));
    END IF;
    FOREACH v_woken IN ARRAY (durable_slot_hand_off(p_key, v_override, p_now, p_active, p_terminal)).woken LOOP
        IF NOT p_wake OR EXISTS (
            SELECT 1 FROM durable_runtag t JOIN durable_workflowrun r ON r.id = t.run_id
             WHERE r.run_id = v_woken AND starts_with(t.tag, 'concurrency:')
               AND (SELECT l."limit" IS NOT NULL AND jsonb_array_length(l.count_statuses) > 0
                           AND NOT l.count_statuses ? 'suspended'
                      FROM durable_concurrencylock l WHERE l.key = substr(t.tag, length('concurrency:') + 1))) THEN
            v_wake := v_wake || v_woken;
            CONTINUE;
        END IF;
        UPDATE durable_workflowrun r
           SET status = 'pending', updated_at = p_now, dispatched_at = p_now, redispatches = 0,
               waiting_for = '', wake_at = NULL
         WHERE r.run_id = v_woken AND r.status = 'suspended' AND r.waiting_for = 'slot:' || p_key
        RETURNING r.* INTO v_run;
        CONTINUE WHEN NOT FOUND;  -- woken or cancelled meanwhile: nothing to do, as on the ORM path
        UPDATE durable_runtag t SET status = 'pending' WHERE t.run_id = v_run.id;
        v_started := v_started || jsonb_build_array(to_jsonb(v_run) || jsonb_build_object(
            'parent_run_id', (SELECT p.run_id FROM durable_workflowrun p WHERE p.id = v_run.parent_id)));
    END LOOP;
    RETURN jsonb_build_object('started', v_started, 'wake', to_jsonb(v_wake));
END;
$$;
