-- durable_release_slot, durable_slot_hand_off: a step-level quota's release and
-- hand-off in one round trip (PostgreSQL). Installed by migration 0023; a change
-- here needs a new file in durable/sql/migrations/ and a migration that runs it.
-- Each does what durable/stores/slots.py does through the ORM on other
-- databases (release, _hand_off); p_now comes from the caller, as the ORM path
-- takes it from the application's clock, and the statuses from durable.status
-- (p_active: the statuses of a run whose held slot counts; p_terminal: those of
-- a run whose waiting row is dropped).
--
-- Every write that can change a key's count of slots happens under the lock of
-- the key's durable_concurrencylock row, the row run admission locks; one key
-- is locked per call, so these never deadlock with admission or each other.

-- durable_slot_hand_off: give the free slots of p_key to its waiting steps, oldest
-- first; the caller holds the key's row lock (p_override: its limit_override).
-- Returns the run ids given a slot, in that order. A waiting row whose run ended
-- is deleted. The count of held slots is made once: under the key's lock nothing
-- else takes a slot, and a slot freed meanwhile (a journal write, a cancel) is
-- handed on by the release that follows it. A held row counts while its run is
-- active and its step is not journaled ('completed' or 'failed').
CREATE OR REPLACE FUNCTION durable_slot_hand_off(
    p_key text,
    p_override integer,
    p_now timestamp with time zone,
    p_active text[],
    p_terminal text[]
) RETURNS text[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_woken text[] := '{}';
    v_held bigint;
    v_id bigint;
    v_limit integer;
    v_status text;
    v_run_id text;
BEGIN
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
        IF v_held IS NULL THEN
            SELECT count(*) INTO v_held
              FROM durable_stepslot s JOIN durable_workflowrun r ON r.id = s.run_id
             WHERE s.key = p_key AND s.status = 'held' AND r.status = ANY (p_active)
               AND NOT EXISTS (
                   SELECT 1 FROM durable_steprecord j
                    WHERE j.run_id = s.run_id AND j.position = s.position AND j.outcome IN ('completed', 'failed'));
        END IF;
        EXIT WHEN v_held >= COALESCE(p_override, v_limit);
        UPDATE durable_stepslot s SET status = 'held', lease = '', granted_at = p_now WHERE s.id = v_id;
        v_held := v_held + 1;
        v_woken := v_woken || v_run_id;
    END LOOP;
    RETURN v_woken;
END;
$$;

-- durable_release_slot: the step at p_position of run p_run_id ended (journaled, or
-- stopped): lock p_key's row, delete the step's held row of lease p_lease, and
-- hand the key's free slots on (durable_slot_hand_off). Returns the run ids given
-- a slot; none when the row is gone already (a takeover freed it). A key without
-- a row (never created) is not locked, as on the ORM path.
CREATE OR REPLACE FUNCTION durable_release_slot(
    p_run_id text,
    p_position integer,
    p_key text,
    p_lease text,
    p_now timestamp with time zone,
    p_active text[],
    p_terminal text[]
) RETURNS text[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_override integer;
BEGIN
    SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_key FOR UPDATE;
    DELETE FROM durable_stepslot s USING durable_workflowrun r
     WHERE r.id = s.run_id AND r.run_id = p_run_id AND s.position = p_position
       AND s.key = p_key AND s.lease = p_lease AND s.status = 'held';
    IF NOT FOUND THEN
        RETURN '{}';
    END IF;
    RETURN durable_slot_hand_off(p_key, v_override, p_now, p_active, p_terminal);
END;
$$;
