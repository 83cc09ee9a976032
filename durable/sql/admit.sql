-- durable_admit: the whole REJECT admission of a start in one round trip (PostgreSQL).
-- Installed by migration 0012 (0004 installed the first version, 0006 the second,
-- 0011 the third); a change here needs a new file in durable/sql/migrations/ and a
-- migration that runs it.
--
-- p_quotas: [{"key", "limit", "statuses": [...], "group"}], sorted by key; "limit"
-- is the code's limit: an operator's override on the key's row (limit_override)
-- replaces it, read in the statement that counts (step 1) and again under the
-- row's lock (step 2), so a change committed before a start applies to it.
-- p_run_id_given: the caller chose p_run_id (an idempotent start), rather than a fresh id.
-- Returns one row: outcome 'created' (with the run's id), 'full' (key, limit in
-- effect, active of the first full key, and what the Retry-After estimate is made
-- of: durations, the key's recent run durations (recent_durations, kept by
-- durable_finish), and oldest_age, the seconds its oldest run in flight has held
-- its slot) or 'exists' (the run id is taken).
--
-- 1. Refuse at once, without waiting for any lock, when a key is already full:
--    the committed count says so, and nothing is created.
-- 2. Otherwise lock each key's row in key order, creating a missing row first
--    (a row that does not exist locks nothing; INSERT ... ON CONFLICT DO NOTHING
--    waits for a concurrent insert of the same key), and count again: this
--    function is VOLATILE, so each statement sees what committed before it, in
--    particular every start admitted while this one waited for the lock.
-- 3. Insert the run and its tags, still holding the locks.
-- A refusal records its limits on the keys' rows that differ, skipping rows
-- locked by another starter (so it never waits); when every row holds them
-- already (the usual refusal: the same limit as the starts before it) it runs
-- no UPDATE statement at all, which keeps a refusal storm on a hot key cheap.
-- A refusal of a given run id first makes sure no run has that id: a start of
-- the same id in a transaction not yet committed is invisible, so it tries to
-- insert the run id (ON CONFLICT DO NOTHING waits for that transaction), and
-- answers 'exists' when it is taken, else deletes its row and answers 'full'.
-- A start without a run id of its own refuses exactly as before: one statement.
-- 0012 added the columns durations and oldest_age to the result: the function is dropped first.
DROP FUNCTION IF EXISTS durable_admit(jsonb, text, text, text, text, text, jsonb, text, text, boolean);
CREATE OR REPLACE FUNCTION durable_admit(
    p_quotas jsonb,
    p_count_namespace text,
    p_run_id text,
    p_workflow text,
    p_version text,
    p_namespace text,
    p_input jsonb,
    p_parent_run_id text,
    p_queue text,
    p_run_id_given boolean
) RETURNS TABLE (
    outcome text, full_key text, full_limit integer, active bigint, run_pk bigint, durations jsonb,
    oldest_age double precision
)
LANGUAGE plpgsql VOLATILE
-- Generic plans: with custom plans (the default) PostgreSQL planned some of its
-- statements again at every call, which doubled the time of a refusal (measured).
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    q jsonb;
    v_key text;
    v_limit integer;
    v_code_limit integer;
    v_override integer;
    v_durations jsonb;
    v_oldest_age double precision;
    v_statuses text[];
    v_active bigint;
    v_full boolean := false;
    v_stale boolean := false;
    v_parent bigint;
    v_pk bigint;
BEGIN
    FOR q IN SELECT value FROM jsonb_array_elements(p_quotas) LOOP
        v_key := q->>'key';
        v_statuses := ARRAY(SELECT jsonb_array_elements_text(q->'statuses'));
        SELECT count(*), COALESCE(
                   (SELECT l.limit_override FROM durable_concurrencylock l WHERE l.key = v_key),
                   (q->>'limit')::integer)
          INTO v_active, v_limit FROM durable_runtag t
         WHERE t.tag = 'concurrency:' || v_key AND t.status = ANY (v_statuses)
           AND (p_count_namespace IS NULL OR t.namespace = p_count_namespace);
        IF v_active >= v_limit THEN
            v_full := true;
            EXIT;
        END IF;
    END LOOP;

    IF NOT v_full THEN
        FOR q IN SELECT value FROM jsonb_array_elements(p_quotas) LOOP
            v_key := q->>'key';
            v_code_limit := (q->>'limit')::integer;
            v_statuses := ARRAY(SELECT jsonb_array_elements_text(q->'statuses'));
            SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = v_key FOR UPDATE;
            IF NOT FOUND THEN
                INSERT INTO durable_concurrencylock (key, "limit", count_statuses, rr_cursor)
                VALUES (v_key, v_code_limit, q->'statuses', '') ON CONFLICT (key) DO NOTHING;
                SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = v_key FOR UPDATE;
            END IF;
            v_limit := COALESCE(v_override, v_code_limit);
            UPDATE durable_concurrencylock l SET "limit" = v_code_limit, count_statuses = q->'statuses'
             WHERE l.key = v_key AND (l."limit" IS DISTINCT FROM v_code_limit OR l.count_statuses <> q->'statuses');
            SELECT count(*) INTO v_active FROM durable_runtag t
             WHERE t.tag = 'concurrency:' || v_key AND t.status = ANY (v_statuses)
               AND (p_count_namespace IS NULL OR t.namespace = p_count_namespace);
            IF v_active >= v_limit THEN
                v_full := true;
                EXIT;
            END IF;
        END LOOP;
    END IF;

    IF p_parent_run_id IS NOT NULL AND NOT v_full THEN
        SELECT r.id INTO v_parent FROM durable_workflowrun r WHERE r.run_id = p_parent_run_id;
    END IF;
    IF NOT v_full OR p_run_id_given THEN
        INSERT INTO durable_workflowrun (
            run_id, workflow, version, namespace, status, input, attempt, generation,
            lease, worker, queue, waiting_for, dispatched_at, parent_id, fenced
        ) VALUES (
            p_run_id, p_workflow, p_version, p_namespace, 'pending', p_input, 0, 0,
            '', '', p_queue, '', now(), v_parent, p_count_namespace IS NOT NULL
        ) ON CONFLICT (run_id) DO NOTHING
        RETURNING id INTO v_pk;
        IF v_pk IS NULL THEN
            RETURN QUERY SELECT 'exists'::text, NULL::text, NULL::integer, NULL::bigint, NULL::bigint,
                                NULL::jsonb, NULL::double precision;
            RETURN;
        END IF;
    END IF;
    IF v_full THEN
        IF v_pk IS NOT NULL THEN
            DELETE FROM durable_workflowrun r WHERE r.id = v_pk;  -- the probe of a given run id
        END IF;
        -- Record the refused start's limits on its keys' rows (the quota read model
        -- and hand-offs read them): only rows whose values differ, never waiting
        -- for a row another starter holds locked.
        FOR q IN SELECT value FROM jsonb_array_elements(p_quotas) LOOP
            v_stale := EXISTS (
                SELECT 1 FROM durable_concurrencylock l
                 WHERE l.key = q->>'key'
                   AND (l."limit" IS DISTINCT FROM (q->>'limit')::integer OR l.count_statuses <> q->'statuses'));
            EXIT WHEN v_stale;
        END LOOP;
        IF v_stale THEN
            UPDATE durable_concurrencylock l SET "limit" = (e->>'limit')::integer, count_statuses = e->'statuses'
              FROM jsonb_array_elements(p_quotas) AS e
             WHERE l.key = e->>'key' AND l.key IN (
                   SELECT k.key FROM durable_concurrencylock k JOIN jsonb_array_elements(p_quotas) AS p
                       ON k.key = p->>'key'
                    WHERE k."limit" IS DISTINCT FROM (p->>'limit')::integer OR k.count_statuses <> p->'statuses'
                      FOR UPDATE OF k SKIP LOCKED);
        END IF;
        -- The estimate of Retry-After, on the full key (its in-flight runs are few: at most its limit).
        IF v_limit > 0 THEN
            SELECT (SELECT l.recent_durations FROM durable_concurrencylock l WHERE l.key = v_key),
                   extract(epoch FROM now() - min(t.created_at))
              INTO v_durations, v_oldest_age FROM durable_runtag t
             WHERE t.tag = 'concurrency:' || v_key AND t.status = ANY (v_statuses)
               AND (p_count_namespace IS NULL OR t.namespace = p_count_namespace);
        END IF;
        RETURN QUERY SELECT 'full'::text, v_key, v_limit, v_active, NULL::bigint, v_durations, v_oldest_age;
        RETURN;
    END IF;
    INSERT INTO durable_runtag (run_id, tag, status, namespace, group_key)
    SELECT v_pk, 'concurrency:' || (e->>'key'), 'pending', p_namespace, e->>'group'
      FROM jsonb_array_elements(p_quotas) AS e;
    RETURN QUERY SELECT 'created'::text, NULL::text, NULL::integer, NULL::bigint, v_pk, NULL::jsonb,
                        NULL::double precision;
END;
$$;
