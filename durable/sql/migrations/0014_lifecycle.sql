-- durable_claim, durable_record_step, durable_end (and durable_finish): each
-- state change of an execution in one round trip (PostgreSQL). Installed by
-- migration 0008, durable_end added by 0014; a change here needs a new file in
-- durable/sql/migrations/ and a migration that runs it. Each is the
-- compare-and-set of the DjangoStore method of the same name on other databases;
-- times come from the caller (p_now), as the ORM path takes them from the
-- application's clock.

-- durable_claim: take a pending or blocked run (or a running one whose heartbeat
-- is older than p_stale_before) for p_lease, mirror 'running' on its tags, and
-- return the run (its columns, with its parent's run id) and its journal, in
-- position order, as one jsonb value {"run": {...}, "steps": [...]}; NULL when
-- the run is not to be executed. The UPDATE takes the row's lock: a concurrent
-- claim waits for it, then finds the run running with a fresh heartbeat.
CREATE OR REPLACE FUNCTION durable_claim(
    p_run_id text,
    p_lease text,
    p_worker text,
    p_stale_before timestamp with time zone,
    p_now timestamp with time zone
) RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_run durable_workflowrun;
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
    UPDATE durable_runtag t SET status = 'running' WHERE t.run_id = v_run.id;
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

-- durable_finish: end a run running under p_lease with p_status (clearing the
-- lease), mirror the status on its tags; false when the run no longer belongs
-- to p_lease.
CREATE OR REPLACE FUNCTION durable_finish(
    p_run_id text,
    p_lease text,
    p_status text,
    p_output jsonb,
    p_error jsonb,
    p_now timestamp with time zone
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_pk bigint;
BEGIN
    UPDATE durable_workflowrun r
       SET status = p_status, updated_at = p_now, output = p_output, error = p_error, lease = '', finished_at = p_now
     WHERE r.run_id = p_run_id AND r.status = 'running' AND r.lease = p_lease
    RETURNING r.id INTO v_pk;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE durable_runtag t SET status = p_status WHERE t.run_id = v_pk;
    RETURN true;
END;
$$;

-- durable_end: durable_finish that also says whether a promote must follow. NULL
-- when the run no longer belongs to p_lease, else the number of the run's quota
-- keys (its tags named 'concurrency:...'): 0 means no slot was freed, so the
-- caller skips the hand-off. durable_finish stays for workers of the previous
-- release while a deploy rolls.
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
    v_keys integer;
BEGIN
    UPDATE durable_workflowrun r
       SET status = p_status, updated_at = p_now, output = p_output, error = p_error, lease = '', finished_at = p_now
     WHERE r.run_id = p_run_id AND r.status = 'running' AND r.lease = p_lease
    RETURNING r.id INTO v_pk;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    WITH moved AS (
        UPDATE durable_runtag t SET status = p_status WHERE t.run_id = v_pk RETURNING t.tag
    )
    SELECT count(*) FILTER (WHERE left(moved.tag, 12) = 'concurrency:') INTO v_keys FROM moved;
    RETURN v_keys;
END;
$$;
