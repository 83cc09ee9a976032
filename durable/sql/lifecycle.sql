-- durable_take (durable_claim), durable_record_step, durable_end (and
-- durable_finish): each state change of an execution in one round trip
-- (PostgreSQL). Installed by migration 0027 (0008 installed the first version,
-- 0012 the second, which records run durations; 0014 added durable_end; 0019
-- added durable_take, the claim that may commit asynchronously; 0022 has
-- durable_end say whether a hand-off must follow; 0027 has it read the keys'
-- rows one at a time, by key); a change here
-- needs a new file in durable/sql/migrations/ and a migration that runs it. Each
-- is the compare-and-set of the DjangoStore method of the same name on other
-- databases; times come from the caller (p_now), as the ORM path takes them from
-- the application's clock.

-- durable_take: take a pending or blocked run (or a running one whose heartbeat
-- is older than p_stale_before) for p_lease, mirror 'running' on its tags, and
-- return the run (its columns, with its parent's run id) and its journal, in
-- position order, as one jsonb value {"run": {...}, "steps": [...]}; NULL when
-- the run is not to be executed. The UPDATE takes the row's lock: a concurrent
-- claim waits for it, then finds the run running with a fresh heartbeat.
--
-- p_async_commit: commit the call's own transaction without waiting for its WAL
-- to reach the disk (synchronous_commit off, for this transaction only; the
-- caller passes it only when the call is a transaction of its own), when losing
-- the claim cannot change what any quota counts: every quota key of the run
-- (each 'concurrency:' tag, a burst's pool included) counts 'running' only if it
-- also counts 'pending' and 'blocked', the statuses a claim takes a run from
-- (the default statuses count all three). A claim that a crash of the database
-- loses right after it leaves the run as it was (pending, blocked, or running
-- under the stale lease it took over): the execution's next write finds its
-- lease gone and stops, and the run is executed again from its journal, as
-- after a worker's crash. Nothing the execution wrote can survive it either: a
-- later synchronous commit (its first journal write) flushes the WAL, the claim
-- included, before its own. A key that counts 'running' but not 'pending' takes
-- its slot at the claim, so such a claim commits synchronously.
CREATE OR REPLACE FUNCTION durable_take(
    p_run_id text,
    p_lease text,
    p_worker text,
    p_stale_before timestamp with time zone,
    p_now timestamp with time zone,
    p_async_commit boolean
) RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_run durable_workflowrun;
    v_async boolean;
BEGIN
    UPDATE durable_workflowrun r
       SET status = 'running', updated_at = p_now, lease = p_lease, worker = p_worker,
           attempt = r.attempt + 1, heartbeat_at = p_now,
           started_at = COALESCE(r.started_at, p_now), redispatches = 0
     WHERE r.run_id = p_run_id
       AND (r.status IN ('pending', 'blocked') OR (r.status = 'running' AND r.heartbeat_at < p_stale_before))
    RETURNING r.* INTO v_run;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- The tags mirror 'running'; the same statement reads their keys' statuses.
    WITH tagged AS (
        UPDATE durable_runtag t SET status = 'running' WHERE t.run_id = v_run.id RETURNING t.tag
    )
    SELECT p_async_commit AND NOT EXISTS (
        SELECT 1 FROM tagged g LEFT JOIN durable_concurrencylock l ON l.key = substr(g.tag, 13)
         WHERE left(g.tag, 12) = 'concurrency:'
           AND (l.key IS NULL OR (l.count_statuses ? 'running'
                                  AND NOT (l.count_statuses ? 'pending' AND l.count_statuses ? 'blocked'))))
      INTO v_async;
    IF v_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN jsonb_build_object(
        'run', to_jsonb(v_run) || jsonb_build_object(
            'parent_run_id', (SELECT p.run_id FROM durable_workflowrun p WHERE p.id = v_run.parent_id)),
        'steps', COALESCE((
            SELECT jsonb_agg(jsonb_build_object(
                       'position', s.position, 'name', s.name, 'outcome', s.outcome, 'output', s.output,
                       'error', s.error, 'attempts', s.attempts, 'started_at', s.started_at)
                   ORDER BY s.position)
              FROM durable_steprecord s WHERE s.run_id = v_run.id), '[]'::jsonb));
END;
$$;

-- durable_claim: durable_take committing synchronously, for workers of the
-- previous release while a deploy rolls.
CREATE OR REPLACE FUNCTION durable_claim(
    p_run_id text,
    p_lease text,
    p_worker text,
    p_stale_before timestamp with time zone,
    p_now timestamp with time zone
) RETURNS jsonb
LANGUAGE sql VOLATILE AS $$
    SELECT durable_take(p_run_id, p_lease, p_worker, p_stale_before, p_now, false);
$$;

-- durable_record_step: journal one step of a run running under p_lease (replacing
-- the entry at its position, a 'waiting' one) and beat its heartbeat; false, and
-- nothing written, when the run no longer belongs to p_lease. The UPDATE of the
-- heartbeat is the lease check and takes the row's lock first, as the ORM path's
-- SELECT ... FOR UPDATE does.
CREATE OR REPLACE FUNCTION durable_record_step(
    p_run_id text,
    p_lease text,
    p_position integer,
    p_name text,
    p_outcome text,
    p_output jsonb,
    p_error jsonb,
    p_attempts integer,
    p_started_at timestamp with time zone,
    p_now timestamp with time zone
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_pk bigint;
BEGIN
    UPDATE durable_workflowrun r SET heartbeat_at = p_now
     WHERE r.run_id = p_run_id AND r.status = 'running' AND r.lease = p_lease
    RETURNING r.id INTO v_pk;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO durable_steprecord (run_id, position, name, outcome, output, error, attempts, started_at, finished_at)
    VALUES (v_pk, p_position, p_name, p_outcome, p_output, p_error, p_attempts, p_started_at, p_now)
    ON CONFLICT (run_id, position) DO UPDATE
       SET name = EXCLUDED.name, outcome = EXCLUDED.outcome, output = EXCLUDED.output, error = EXCLUDED.error,
           attempts = EXCLUDED.attempts, started_at = EXCLUDED.started_at, finished_at = EXCLUDED.finished_at;
    RETURN true;
END;
$$;

-- durable_end: end a run running under p_lease with p_status (clearing the
-- lease), mirror the status on its tags; NULL when the run no longer belongs to
-- p_lease, else the number of the run's quota keys (its tags named
-- 'concurrency:...') whose freed slot the caller must hand on (durable_promote,
-- after commit); 0: no hand-off follows.
--
-- A key needs no hand-off when the call holds its row's lock and no run of the
-- key is queued. The lock is only tried (SKIP LOCKED: a finish never waits for
-- admission, and waits for no lock at all, so it adds no deadlock), and it is
-- held until the commit: every start or re-entry that queues a run on the key
-- does so under that lock, so it either committed before the lock was taken
-- (the check, a statement of its own after the lock, sees its queued run) or
-- waits for this commit and then counts this run as ended (it gets the slot
-- itself, or queues behind runs that hold every slot). A key whose row another
-- transaction holds (a starter of the key), or that has no row, needs the
-- hand-off, as every key did before 0022. So a run of a REJECT key (or of a
-- queueing key with an empty queue) ends in this one round trip.
--
-- In the same statement as the tags, append the time the run held each key's
-- slot (now minus its tag's creation) to the key's recent_durations (the last
-- 16, what a refusal's Retry-After is estimated from): a sample, only when the
-- key's last one is a second old or more (durations_at), so a busy key's row
-- is not rewritten by every finish (each rewrite is a new row version that
-- every admission of the key reads past until it is pruned; a lock is not one).
--
-- The keys' rows are locked and sampled one key at a time, by key: joined with
-- the tags in one statement (0022), the generic plan read every key's row (a
-- Seq Scan, 2 ms with the 15,000 keys of the bench's section (a)) whenever the
-- statistics said a run has many tags.
CREATE OR REPLACE FUNCTION durable_end(
    p_run_id text,
    p_lease text,
    p_status text,
    p_output jsonb,
    p_error jsonb,
    p_now timestamp with time zone
) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_pk bigint;
    v_keys text[];
    v_seconds numeric[];
    v_locked text[] := '{}';
    v_sampled_at timestamp with time zone;
    i integer;
BEGIN
    UPDATE durable_workflowrun r
       SET status = p_status, updated_at = p_now, output = p_output, error = p_error, lease = '', finished_at = p_now
     WHERE r.run_id = p_run_id AND r.status = 'running' AND r.lease = p_lease
    RETURNING r.id INTO v_pk;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    WITH held AS (
        UPDATE durable_runtag t SET status = p_status WHERE t.run_id = v_pk
        RETURNING substr(t.tag, 13) AS key, left(t.tag, 12) = 'concurrency:' AS quota,
                  round(greatest(extract(epoch FROM p_now - t.created_at), 0)::numeric, 3) AS seconds
    )
    SELECT COALESCE(array_agg(h.key) FILTER (WHERE h.quota), '{}'),
           COALESCE(array_agg(h.seconds) FILTER (WHERE h.quota), '{}')
      INTO v_keys, v_seconds
      FROM held h;
    FOR i IN 1 .. cardinality(v_keys) LOOP
        SELECT l.durations_at INTO v_sampled_at
          FROM durable_concurrencylock l WHERE l.key = v_keys[i]
           FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;  -- held by another transaction, or no row: the hand-off follows
        v_locked := v_locked || v_keys[i];
        IF v_sampled_at IS NULL OR v_sampled_at <= p_now - interval '1 second' THEN
            UPDATE durable_concurrencylock l
               SET durations_at = p_now,
                   recent_durations = CASE
                       WHEN jsonb_array_length(COALESCE(l.recent_durations, '[]'::jsonb)) >= 16
                       THEN (l.recent_durations - 0) || to_jsonb(v_seconds[i])
                       ELSE COALESCE(l.recent_durations, '[]'::jsonb) || to_jsonb(v_seconds[i]) END
             WHERE l.key = v_keys[i];
        END IF;
    END LOOP;
    -- A statement of its own: it sees every queued run committed before the locks were taken.
    RETURN (SELECT count(*) FROM unnest(v_keys) AS k(key)
             WHERE k.key <> ALL (v_locked)
                OR EXISTS (SELECT 1 FROM durable_runtag t WHERE t.tag = 'concurrency:' || k.key AND t.status = 'queued'));
END;
$$;

-- durable_finish: durable_end's answer as a boolean (false: the run no longer
-- belongs to p_lease), for workers of the previous release while a deploy rolls.
CREATE OR REPLACE FUNCTION durable_finish(
    p_run_id text,
    p_lease text,
    p_status text,
    p_output jsonb,
    p_error jsonb,
    p_now timestamp with time zone
) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT durable_end(p_run_id, p_lease, p_status, p_output, p_error, p_now) IS NOT NULL;
$$;
