-- durable_admit: the whole REJECT admission of a start in one round trip (PostgreSQL).
-- Installed by migration 0029 (0004 installed the first version, 0006 the second,
-- 0011 the third, 0012 the fourth, 0017 the fifth, 0018 the sixth, 0025 the
-- seventh, 0026 the eighth, 0028 the ninth; 0029 added durable_full_key); a change here
-- needs a new file in durable/sql/migrations/ and a migration that runs it.
-- Every count of a key's runs reads durable_counted_tags (0025), which reads no
-- finished run of the key unless its count_statuses name a terminal status.
--
-- p_quotas: [{"key", "limit", "statuses": [...], "group", "burst"?, "pool_limit"?,
-- "lock_pool"?, "in_transaction"?, "lock_first"?}], sorted by key; "limit" is the code's limit: an operator's
-- override on the key's row (limit_override) replaces it, read in the statement
-- that counts (step 1) and again under the row's lock (step 2), so a change
-- committed before a start applies to it.
-- p_run_id_given: the caller chose p_run_id (an idempotent start), rather than a fresh id.
-- Returns one row: outcome 'created' (with the run's id), 'full' (key, limit in
-- effect, active of the first full key, and what the Retry-After estimate is made
-- of: durations, the key's recent run durations (recent_durations, kept by
-- durable_end), and oldest_age, the seconds its oldest run in flight has held
-- its slot) or 'exists' (the run id is taken). burst: NULL, except for a start
-- with a burst: on 'created' {"borrowed": [pools the run borrows from], "keys":
-- [its keys that borrow] (0018: a key within its limit does not), on a
-- refusal by a key with a burst {"source": "pool" | "up_to", "pool",
-- "pool_limit", "pool_active", "up_to", "borrowed"} (the estimate is then the
-- pool's when the pool refused).
--
-- 1. Refuse at once, without waiting for any lock, when a key is already full:
--    the committed count says so, and nothing is created. A start of one key
--    without a burst with "lock_first" (0026; the caller's guess that the key has
--    room: its last start there was not refused) takes the key's row first if no
--    one holds it (SKIP LOCKED: never waiting) and counts only under the lock, in
--    step 2; a row held by another starter (or not created yet) is counted first,
--    as without the flag. A refusal that took the row ends with the call's
--    transaction, which holds the lock until then.
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
--
-- A key with a burst ("burst": {"pool", "up_to"}, "pool_limit": the pool's
-- limit from DURABLE["POOLS"], see durable/runtime/bursts.py): its runs and its
-- borrowed runs (tag 'borrowed:<key>') are counted in one statement. At up_to
-- runs (or its limit, if higher) it refuses; with fewer than its limit guaranteed
-- runs the run is guaranteed (the pool is not read); else it borrows: the pool's
-- row is locked, its runs (tag 'concurrency:<pool>') counted, and the run takes
-- the tags 'concurrency:<pool>' and 'borrowed:<key>', or the start is refused.
-- The pool is locked after every key, only when a run borrows: a lock is waited
-- for only when it sorts after every lock held (as every other locker of durable
-- does, so no deadlock); a pool sorting before a key held is taken with NOWAIT,
-- and if it is busy the function raises lock_not_available (55P03; a missing
-- row is created, see durable_lock_pool), ending its transaction or savepoint:
-- the caller then calls again with "lock_pool": true, which locks the pool with
-- the keys, in key order, from the start. With "in_transaction": true (0018: a
-- start inside the caller's own transaction, which may hold keys of earlier
-- starts sorting after the pool) that held a lock before the call (it has a
-- transaction id), a pool is never waited for: it is taken with NOWAIT wherever
-- it sorts, and the caller calls again (a bounded number of times) or gives up.
-- A busy pool is then answered with lock_not_available whose DETAIL says whether
-- the transaction held nothing before the call ('durable: nothing held': the
-- caller may call again with "lock_pool": true, as outside a transaction) or
-- not ('durable: locks held').
-- A pool's row always records the statuses of the burst that names it (a pool
-- counts the default statuses), never those of the key it is locked beside
-- (0017 wrote a plain key's narrower count_statuses there, and hand-offs on the
-- pool then over-filled it).
-- 0012 added the columns durations and oldest_age to the result, 0017 the column burst:
-- the function is dropped first. 0026 runs fewer queries for the same answers: it walks
-- p_quotas by index and reads each quota's statuses with durable_statuses (simple
-- expressions, where a FOR ... IN SELECT and ARRAY(SELECT ...) each ran a query),
-- reads the locked row's limits with its lock and updates them only when they differ,
-- returns with RETURN NEXT, and with
-- "lock_first" an admitted start counts once, under the lock (step 1). 0028: the count of
-- step 1 also reads what a refusal answers and records (the key row's limits, its recent
-- durations, the age of the oldest run counted), so a refusal of one key by that count
-- runs one query instead of three.

-- durable_statuses: a quota's "statuses" (a JSON array of run status names) as text[].
-- A status name is a word (durable checks count_statuses against the run statuses), so
-- the array's JSON text is an array literal once its brackets are braces. One SQL
-- expression, inlined where it is called: PL/pgSQL evaluates it as a simple
-- expression, without the query that ARRAY(SELECT jsonb_array_elements_text(...)) runs.
CREATE OR REPLACE FUNCTION durable_statuses(p_statuses jsonb) RETURNS text[]
LANGUAGE sql STABLE AS $$
    SELECT translate(p_statuses::text, '[]', '{}')::text[]
$$;

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
    oldest_age double precision, burst jsonb
)
LANGUAGE plpgsql VOLATILE
-- Generic plans: with custom plans (the default) PostgreSQL planned some of its
-- statements again at every call, which doubled the time of a refusal (measured).
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    q jsonb;
    i integer;
    v_key text;
    v_limit integer;
    v_code_limit integer;
    v_override integer;
    v_row_limit integer;
    v_row_statuses jsonb;
    v_row_burst jsonb;
    v_durations jsonb;
    v_oldest_age double precision;
    v_statuses text[];
    v_active bigint;
    v_full boolean := false;
    v_stale boolean := false;
    v_counted boolean := false;
    v_parent bigint;
    v_pk bigint;
    v_bursting boolean;
    v_burst jsonb;
    v_borrowed bigint;
    v_pool text;
    v_pool_limit integer;
    v_pool_active bigint;
    v_pool_statuses jsonb;
    v_estimate text;
    v_held text[] := '{}';
    v_borrows jsonb := '[]'::jsonb;
    v_in_transaction boolean;
    v_fresh boolean;
    v_nowait boolean;
    v_wait boolean;
    v_locked boolean := false;
    b jsonb;
BEGIN
    v_bursting := jsonb_path_exists(p_quotas, '$[*].burst');
    -- Inside the caller's transaction, which held no lock before this call if it has no transaction id yet.
    v_in_transaction := jsonb_path_exists(p_quotas, '$[*] ? (@.in_transaction == true)');
    v_fresh := pg_current_xact_id_if_assigned() IS NULL;
    v_nowait := v_in_transaction AND NOT v_fresh;
    FOR i IN 0 .. jsonb_array_length(p_quotas) - 1 LOOP
        q := p_quotas->i;
        v_key := q->>'key';
        v_statuses := durable_statuses(q->'statuses');
        IF q ? 'lock_first' AND jsonb_array_length(p_quotas) = 1 AND NOT q ? 'burst' THEN
            -- Its row when no one holds it (never waiting): counted under the lock in step 2.
            SELECT l.limit_override, l."limit", l.count_statuses, l.burst
              INTO v_override, v_row_limit, v_row_statuses, v_row_burst
              FROM durable_concurrencylock l WHERE l.key = v_key FOR UPDATE SKIP LOCKED;
            v_locked := FOUND;
            CONTINUE WHEN v_locked;
        END IF;
        IF q ? 'burst' THEN
            SELECT count(*) FILTER (WHERE t.tag = 'concurrency:' || v_key),
                   count(*) FILTER (WHERE t.tag = 'borrowed:' || v_key),
                   COALESCE((SELECT l.limit_override FROM durable_concurrencylock l WHERE l.key = v_key),
                            (q->>'limit')::integer)
              INTO v_active, v_borrowed, v_limit
              FROM durable_counted_tags(ARRAY['concurrency:' || v_key, 'borrowed:' || v_key], v_statuses, p_count_namespace) AS t;
            IF v_active >= GREATEST((q->'burst'->>'up_to')::integer, v_limit) OR v_active - v_borrowed >= v_limit THEN
                v_pool := q->'burst'->>'pool';
                SELECT count(*), COALESCE((SELECT l.limit_override FROM durable_concurrencylock l WHERE l.key = v_pool),
                                          (q->>'pool_limit')::integer)
                  INTO v_pool_active, v_pool_limit
                  FROM durable_counted_tags(ARRAY['concurrency:' || v_pool], v_statuses, p_count_namespace) AS t;
                v_burst := durable_burst_refusal(q, v_limit, v_active, v_borrowed, v_pool_limit, v_pool_active);
                IF v_burst IS NOT NULL THEN
                    v_full := true;
                    EXIT;
                END IF;
            END IF;
            CONTINUE;
        END IF;
        -- With what a refusal answers and records, read in the same query (0028).
        SELECT c.n, COALESCE(l.limit_override, (q->>'limit')::integer), c.oldest_age, l.recent_durations,
               l.key IS NOT NULL AND (l."limit" IS DISTINCT FROM (q->>'limit')::integer
                                      OR l.count_statuses <> q->'statuses')
          INTO v_active, v_limit, v_oldest_age, v_durations, v_stale
          FROM (SELECT count(*) AS n, extract(epoch FROM now() - min(t.created_at)) AS oldest_age
                  FROM durable_counted_tags(ARRAY['concurrency:' || v_key], v_statuses, p_count_namespace) AS t) AS c
          LEFT JOIN durable_concurrencylock l ON l.key = v_key;
        IF v_active >= v_limit THEN
            v_full := true;
            v_counted := true;
            EXIT;
        END IF;
    END LOOP;

    IF NOT v_full THEN
        FOR i IN 0 .. jsonb_array_length(p_quotas) - 1 LOOP
            q := p_quotas->i;
            v_key := q->>'key';
            v_code_limit := (q->>'limit')::integer;
            v_statuses := durable_statuses(q->'statuses');
            IF v_bursting THEN
                -- A retry's pools, locked with the keys in key order, each with the
                -- statuses of the burst naming it (not those of the key q).
                FOR v_pool, v_pool_limit, v_pool_statuses IN
                    SELECT d.pool, d.pool_limit, d.statuses FROM (
                        SELECT DISTINCT ON (e.value->'burst'->>'pool')
                               e.value->'burst'->>'pool' AS pool, (e.value->>'pool_limit')::integer AS pool_limit,
                               e.value->'statuses' AS statuses
                          FROM jsonb_array_elements(p_quotas) AS e
                         WHERE (e.value->>'lock_pool')::boolean
                         ORDER BY e.value->'burst'->>'pool', e.value->>'key' COLLATE "C") AS d
                     WHERE d.pool COLLATE "C" < v_key COLLATE "C" AND NOT d.pool = ANY (v_held)
                     ORDER BY d.pool COLLATE "C"
                LOOP
                    PERFORM durable_lock_pool(v_pool, v_pool_limit, v_pool_statuses, NOT v_nowait);
                    v_held := v_held || v_pool;
                END LOOP;
                v_held := v_held || v_key;
            END IF;
            IF NOT v_locked THEN
                SELECT l.limit_override, l."limit", l.count_statuses, l.burst
                  INTO v_override, v_row_limit, v_row_statuses, v_row_burst
                  FROM durable_concurrencylock l WHERE l.key = v_key FOR UPDATE;
            END IF;
            IF NOT v_locked AND NOT FOUND THEN
                INSERT INTO durable_concurrencylock (key, "limit", count_statuses, rr_cursor, burst)
                VALUES (v_key, v_code_limit, q->'statuses', '', q->'burst') ON CONFLICT (key) DO NOTHING;
                SELECT l.limit_override, l."limit", l.count_statuses, l.burst
                  INTO v_override, v_row_limit, v_row_statuses, v_row_burst
                  FROM durable_concurrencylock l WHERE l.key = v_key FOR UPDATE;
            END IF;
            v_limit := COALESCE(v_override, v_code_limit);
            -- The row is locked, so what was read is what is there: the usual start writes nothing.
            IF v_row_limit IS DISTINCT FROM v_code_limit OR v_row_statuses <> q->'statuses'
               OR v_row_burst IS DISTINCT FROM q->'burst' THEN
                UPDATE durable_concurrencylock l SET "limit" = v_code_limit, count_statuses = q->'statuses', burst = q->'burst'
                 WHERE l.key = v_key;
            END IF;
            IF q ? 'burst' THEN
                SELECT count(*) FILTER (WHERE t.tag = 'concurrency:' || v_key),
                       count(*) FILTER (WHERE t.tag = 'borrowed:' || v_key)
                  INTO v_active, v_borrowed
                  FROM durable_counted_tags(ARRAY['concurrency:' || v_key, 'borrowed:' || v_key], v_statuses, p_count_namespace) AS t;
                IF v_active >= GREATEST((q->'burst'->>'up_to')::integer, v_limit) THEN
                    -- At its ceiling: refused without the pool's lock (its count is for the answer).
                    v_pool := q->'burst'->>'pool';
                    SELECT count(*), COALESCE((SELECT l.limit_override FROM durable_concurrencylock l WHERE l.key = v_pool),
                                              (q->>'pool_limit')::integer)
                      INTO v_pool_active, v_pool_limit
                      FROM durable_counted_tags(ARRAY['concurrency:' || v_pool], v_statuses, p_count_namespace) AS t;
                    v_burst := durable_burst_refusal(q, v_limit, v_active, v_borrowed, v_pool_limit, v_pool_active);
                    v_full := true;
                    EXIT;
                END IF;
                IF v_active - v_borrowed >= v_limit THEN
                    -- It borrows: the pool is locked and counted once every key is locked.
                    v_borrows := v_borrows || jsonb_build_array(jsonb_build_object(
                        'q', q, 'limit', v_limit, 'active', v_active, 'borrowed', v_borrowed));
                END IF;
                CONTINUE;
            END IF;
            SELECT count(*) INTO v_active
              FROM durable_counted_tags(ARRAY['concurrency:' || v_key], v_statuses, p_count_namespace) AS t;
            IF v_active >= v_limit THEN
                v_full := true;
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- The pools of the runs that borrow, in pool order, after every key.
    IF NOT v_full AND jsonb_array_length(v_borrows) > 0 THEN
        FOR b IN SELECT e.value FROM jsonb_array_elements(v_borrows) AS e
                  ORDER BY e.value->'q'->'burst'->>'pool' COLLATE "C", e.value->'q'->>'key' COLLATE "C" LOOP
            q := b->'q';
            v_key := q->>'key';
            v_limit := (b->>'limit')::integer;
            v_active := (b->>'active')::bigint;
            v_borrowed := (b->>'borrowed')::bigint;
            v_statuses := durable_statuses(q->'statuses');
            v_pool := q->'burst'->>'pool';
            IF NOT v_pool = ANY (v_held) THEN
                -- Waited for only when it sorts after every lock held (and never inside a
                -- transaction that held locks before); else NOWAIT (55P03 if busy).
                v_wait := NOT v_nowait AND v_pool COLLATE "C" > (SELECT max(h COLLATE "C") FROM unnest(v_held) AS h);
                IF v_in_transaction AND NOT v_wait THEN
                    -- A busy pool says whether the transaction held anything before this call.
                    PERFORM 1 FROM durable_concurrencylock l WHERE l.key = v_pool FOR UPDATE SKIP LOCKED;
                    IF NOT FOUND AND EXISTS (SELECT 1 FROM durable_concurrencylock l WHERE l.key = v_pool) THEN
                        RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
                            MESSAGE = 'durable: the row of pool ' || v_pool || ' is locked by another transaction',
                            DETAIL = CASE WHEN v_fresh THEN 'durable: nothing held' ELSE 'durable: locks held' END;
                    END IF;
                END IF;
                v_override := durable_lock_pool(v_pool, (q->>'pool_limit')::integer, q->'statuses', v_wait);
                v_held := v_held || v_pool;
            ELSE
                SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = v_pool;
            END IF;
            v_pool_limit := COALESCE(v_override, (q->>'pool_limit')::integer);
            SELECT count(*) INTO v_pool_active
              FROM durable_counted_tags(ARRAY['concurrency:' || v_pool], v_statuses, p_count_namespace) AS t;
            v_burst := durable_burst_refusal(q, v_limit, v_active, v_borrowed, v_pool_limit, v_pool_active);
            IF v_burst IS NOT NULL THEN
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
            outcome := 'exists';
            RETURN NEXT;
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
        -- One row at a time, by its key (0026): a join with the quotas was planned (generic
        -- plan) as a scan of every key's row, 1.5 ms a refusal with 20,000 keys (measured).
        -- A refusal of one key by the count of step 1 read its row with the count (0028).
        FOR i IN 0 .. jsonb_array_length(p_quotas) - 1 LOOP
            EXIT WHEN v_counted AND jsonb_array_length(p_quotas) = 1;
            q := p_quotas->i;
            v_stale := EXISTS (
                SELECT 1 FROM durable_concurrencylock l
                 WHERE l.key = q->>'key'
                   AND (l."limit" IS DISTINCT FROM (q->>'limit')::integer OR l.count_statuses <> q->'statuses'));
            EXIT WHEN v_stale;
        END LOOP;
        IF v_stale THEN
            FOR i IN 0 .. jsonb_array_length(p_quotas) - 1 LOOP
                q := p_quotas->i;
                UPDATE durable_concurrencylock l SET "limit" = (q->>'limit')::integer, count_statuses = q->'statuses'
                 WHERE l.key = (
                       SELECT k.key FROM durable_concurrencylock k
                        WHERE k.key = q->>'key'
                          AND (k."limit" IS DISTINCT FROM (q->>'limit')::integer OR k.count_statuses <> q->'statuses')
                          FOR UPDATE SKIP LOCKED);
            END LOOP;
        END IF;
        -- The estimate of Retry-After, on the full key, or on the pool that refused
        -- (its in-flight runs are few: at most its limit).
        v_estimate := CASE WHEN v_burst->>'source' = 'pool' THEN v_burst->>'pool' ELSE v_key END;
        -- Read with the count of step 1 when it refused (0028); else (a refusal under a lock)
        -- read here. At a limit of 0 no run frees a slot: nothing to estimate.
        IF NOT v_counted OR v_limit <= 0 THEN
            v_durations := NULL;  -- what step 1 read of a key it did not refuse is not the answer
            v_oldest_age := NULL;
        END IF;
        IF NOT v_counted AND (v_limit > 0 OR v_burst IS NOT NULL) THEN
            SELECT (SELECT l.recent_durations FROM durable_concurrencylock l WHERE l.key = v_estimate),
                   extract(epoch FROM now() - min(t.created_at))
              INTO v_durations, v_oldest_age
              FROM durable_counted_tags(ARRAY['concurrency:' || v_estimate], v_statuses, p_count_namespace) AS t;
        END IF;
        outcome := 'full';
        full_key := v_key;
        full_limit := v_limit;
        active := v_active;
        durations := v_durations;
        oldest_age := v_oldest_age;
        burst := v_burst;
        RETURN NEXT;
        RETURN;
    END IF;
    INSERT INTO durable_runtag (run_id, tag, status, namespace, group_key)
    SELECT v_pk, 'concurrency:' || (e->>'key'), 'pending', p_namespace, e->>'group'
      FROM jsonb_array_elements(p_quotas) AS e;
    IF jsonb_array_length(v_borrows) > 0 THEN
        -- What the runs that borrow add: a slot of each pool (unless one of the
        -- run's own keys is that pool), and the mark of each key that borrows.
        INSERT INTO durable_runtag (run_id, tag, status, namespace, group_key)
        SELECT DISTINCT v_pk, x.tag, 'pending', p_namespace, ''
          FROM jsonb_array_elements(v_borrows) AS e,
               LATERAL (VALUES ('concurrency:' || (e.value->'q'->'burst'->>'pool')),
                               ('borrowed:' || (e.value->'q'->>'key'))) AS x(tag)
         WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_quotas) AS o WHERE 'concurrency:' || (o.value->>'key') = x.tag);
        v_burst := jsonb_build_object(
            'borrowed', ARRAY(SELECT DISTINCT e.value->'q'->'burst'->>'pool' FROM jsonb_array_elements(v_borrows) AS e ORDER BY 1),
            'keys', ARRAY(SELECT e.value->'q'->>'key' FROM jsonb_array_elements(v_borrows) AS e ORDER BY 1));
    END IF;
    outcome := 'created';
    run_pk := v_pk;
    burst := v_burst;
    RETURN NEXT;
END;
$$;

-- durable_full_key: a refusal of a start of one key without a burst, by the count alone
-- (0029). What durable_admit's step 1 reads, without its JSON arguments: a row (the key's
-- runs counted, the limit in effect, and what the Retry-After estimate is made of, NULL at
-- a limit of 0 or less) only when the committed count fills the key and the key's row
-- already records p_limit and p_statuses, so a refusal here has nothing to record;
-- otherwise no row, and the caller calls durable_admit. It takes no lock, as durable_admit
-- refuses by that count without one: the key was full when the query's snapshot was
-- taken. durable asks it for a key whose last start in the process was refused (see
-- _RefusedKeys): a hot key's refusals then send neither the quotas' JSON nor the run's
-- input. PL/pgSQL for its cached generic plan: as a LANGUAGE sql function inlined into the
-- caller's statement, the query was planned at every call (0.6 ms, measured).
CREATE OR REPLACE FUNCTION durable_full_key(
    p_key text,
    p_limit integer,
    p_statuses jsonb,
    p_namespace text
) RETURNS TABLE (active bigint, full_limit integer, durations jsonb, oldest_age double precision)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
    SELECT c.n, COALESCE(l.limit_override, p_limit),
           CASE WHEN COALESCE(l.limit_override, p_limit) > 0 THEN l.recent_durations END,
           CASE WHEN COALESCE(l.limit_override, p_limit) > 0 THEN c.oldest_age END
      FROM (SELECT count(*) AS n, extract(epoch FROM now() - min(t.created_at))::double precision AS oldest_age
              FROM durable_counted_tags(ARRAY['concurrency:' || p_key], durable_statuses(p_statuses), p_namespace) AS t) AS c
      JOIN durable_concurrencylock l ON l.key = p_key
     WHERE c.n >= COALESCE(l.limit_override, p_limit)
       AND l."limit" = p_limit AND l.count_statuses = p_statuses;
END;
$$;

-- durable_burst_refusal: durable_admit's verdict on a start of a key with a burst
-- (q: its entry of p_quotas) that is at its ceiling or borrows: NULL when it is
-- admitted (it borrows, and the pool has room), else the refusal's figures
-- {"source", "pool", "pool_limit", "pool_active", "up_to", "borrowed"}: "up_to"
-- at up_to runs (or at its limit, if higher), "pool" when the pool is full.
CREATE OR REPLACE FUNCTION durable_burst_refusal(
    q jsonb,
    p_limit integer,
    p_active bigint,
    p_borrowed bigint,
    p_pool_limit integer,
    p_pool_active bigint
) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_active >= GREATEST((q->'burst'->>'up_to')::integer, p_limit) OR p_pool_active >= p_pool_limit
        THEN jsonb_build_object(
            'source', CASE WHEN p_active < GREATEST((q->'burst'->>'up_to')::integer, p_limit) THEN 'pool'
                           ELSE 'up_to' END,
            'pool', q->'burst'->>'pool', 'pool_limit', p_pool_limit, 'pool_active', p_pool_active,
            'up_to', (q->'burst'->>'up_to')::integer, 'borrowed', p_borrowed)
    END;
$$;

-- durable_lock_pool: lock the row of pool p_pool for durable_admit (creating it
-- first when it does not exist) and record its limit (p_limit, from
-- DURABLE["POOLS"]) and count_statuses on it; returns its limit_override. With
-- p_wait false (the pool sorts before a lock held, or the start is inside the
-- caller's transaction) it never waits for the row: a busy row raises
-- lock_not_available, and a missing row is created waiting at most 50 ms for a
-- concurrent creation of it (lock_timeout: lock_not_available too).
CREATE OR REPLACE FUNCTION durable_lock_pool(
    p_pool text,
    p_limit integer,
    p_statuses jsonb,
    p_wait boolean
) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_override integer;
    v_lock_timeout text;
BEGIN
    IF p_wait THEN
        SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_pool FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO durable_concurrencylock (key, "limit", count_statuses, rr_cursor)
            VALUES (p_pool, p_limit, p_statuses, '') ON CONFLICT (key) DO NOTHING;
            SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_pool FOR UPDATE;
        END IF;
    ELSE
        SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_pool FOR UPDATE NOWAIT;
        IF NOT FOUND THEN
            -- An INSERT waits for a concurrent, uncommitted insert of the same key: bounded.
            -- (An error ends the caller's transaction or savepoint, which resets the setting.)
            v_lock_timeout := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', '50ms', true);
            INSERT INTO durable_concurrencylock (key, "limit", count_statuses, rr_cursor)
            VALUES (p_pool, p_limit, p_statuses, '') ON CONFLICT (key) DO NOTHING;
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
            SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = p_pool FOR UPDATE NOWAIT;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
                    MESSAGE = 'durable: the row of pool ' || p_pool || ' was deleted meanwhile';
            END IF;
        END IF;
    END IF;
    UPDATE durable_concurrencylock l SET "limit" = p_limit, count_statuses = p_statuses
     WHERE l.key = p_pool AND (l."limit" IS DISTINCT FROM p_limit OR l.count_statuses <> p_statuses);
    RETURN v_override;
END;
$$;
