-- durable_admit_queued, durable_promote: the queueing strategies in one round trip
-- each (PostgreSQL). Installed by migration 0025 (0010 installed the first version,
-- 0012 the second, 0015 the third); a change here needs a new file in
-- durable/sql/migrations/ and a migration that runs it. Every count of a key's
-- runs reads durable_counted_tags (0025), which reads no finished run of the key
-- unless its count_statuses name a terminal status.
--
-- A key's limit is the one its row holds, an operator's override (limit_override)
-- replacing the code's limit (the "limit" of a quota, and the row's "limit"), each
-- read under the row's lock.
--
-- Both take key locks in key order, compared byte by byte (COLLATE "C", which is
-- Python's order of str, the order every other locker of durable uses), so they
-- never deadlock with each other nor with durable_admit or the ORM path.

-- durable_admit_queued: the admission of a start whose quotas are REJECT,
-- GROUP_ROUND_ROBIN, CANCEL_QUEUED_EXCEPT_NEWEST and/or CANCEL_QUEUED_EXCEPT_OLDEST
-- (any mix), as admission.decide and Engine._admit make it.
--
-- p_quotas: [{"key", "limit", "statuses": [...], "group", "strategy", "max_queued",
--   "replaced_error"}] in the start's quota order (the order refusals are decided
--   in); "replaced_error" (CANCEL_QUEUED_EXCEPT_NEWEST): the error of a queued run
--   this start replaces in the key's queue.
-- p_ancestors: [{"run_id", "status"}], the parent of a child start first, as read
--   by the caller.
-- Returns one row: outcome
--   'created' with the status the run was created with ('pending', 'queued', or
--     'cancelled' with run_error and run_finished_at: CANCEL_QUEUED_EXCEPT_OLDEST
--     on a full queue), and superseded: the queued runs it cancelled
--     (CANCEL_QUEUED_EXCEPT_NEWEST), each a row of durable_workflowrun with
--     "parent_run_id", as durable_promote answers them;
--   'full' (ConcurrencyLimitError) with full_key, full_limit (in effect), active and reason:
--     'limit' (a REJECT key full, or a limit of 0 or less), 'lifetime' (finished
--     runs alone fill the cap), 'ancestor' (holder: an ancestor holding a slot of
--     the full key a child would queue on);
--   'queue_full' (ConcurrencyQueueFullError) with full_key, full_limit, active,
--     queued, max_queued;
--   'exists': the run id is taken.
-- durations, oldest_age (a 'full' for reason 'limit', or a 'queue_full'): what the
--   Retry-After estimate is made of, as durable_admit answers them.
--
-- 1. Lock each key's row in key order, creating a missing row first, and record
--    the start's limit and count_statuses on it (so a refused start's limits are
--    recorded too: this function never rolls back what it wrote).
-- 2. Count, under the locks, the runs of each key in its count_statuses, and its
--    queued runs (queueing strategies: runs queued before this one go first).
-- 3. Decide in quota order: REJECT full, limit <= 0, a filled lifetime cap refuse;
--    then a start that finds a key full (or with runs queued) is created
--    cancelled if a CANCEL_QUEUED_EXCEPT_OLDEST key's queue holds max_queued
--    runs, else queued, unless a GROUP_ROUND_ROBIN queue is at max_queued or an
--    ancestor holds a slot of the full key; the oldest queued runs of each
--    CANCEL_QUEUED_EXCEPT_NEWEST key whose queue holds max_queued runs are
--    picked to make room (by creation, then run id).
-- 4. Insert the run and its tags with that status; a run admitted directly moves
--    the round-robin cursor of its GROUP_ROUND_ROBIN keys to its group, as a
--    hand-off does. The picked queued runs are cancelled (compare-and-set, as
--    Engine._cancel's transition; one cancelled meanwhile is skipped).
-- A refusal of a given run id first makes sure no run has that id (as
-- durable_admit does), and answers 'exists' when one has.
-- 0012 added the columns durations and oldest_age to the result, 0015 run_error,
-- run_finished_at and superseded: the function is dropped first.
DROP FUNCTION IF EXISTS durable_admit_queued(jsonb, text, text, text, text, text, jsonb, text, text, boolean, jsonb);
CREATE OR REPLACE FUNCTION durable_admit_queued(
    p_quotas jsonb,
    p_count_namespace text,
    p_run_id text,
    p_workflow text,
    p_version text,
    p_namespace text,
    p_input jsonb,
    p_parent_run_id text,
    p_queue text,
    p_run_id_given boolean,
    p_ancestors jsonb
) RETURNS TABLE (
    outcome text, run_status text, full_key text, full_limit integer, active bigint, queued bigint,
    max_queued integer, reason text, holder text, durations jsonb, oldest_age double precision,
    run_error jsonb, run_finished_at timestamp with time zone, superseded jsonb
)
LANGUAGE plpgsql VOLATILE
-- Generic plans: with custom plans (the default) PostgreSQL planned some of its
-- statements again at every call, which doubled the time of a refusal (measured).
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    q jsonb;
    i integer;
    n integer := jsonb_array_length(p_quotas);
    v_key text;
    v_limit integer;
    v_override integer;
    v_limits integer[] := '{}';
    v_durations jsonb;
    v_oldest_age double precision;
    v_statuses text[];
    v_active bigint[] := '{}';
    v_queued bigint[] := '{}';
    v_count bigint;
    v_finished bigint;
    v_status text := 'pending';
    v_outcome text;
    v_reason text;
    v_holder text;
    v_parent bigint;
    v_pk bigint;
    v_error jsonb;
    v_finished_at timestamp with time zone;
    v_victims bigint[] := '{}';
    v_victim_errors jsonb := '[]'::jsonb;
    v_victim bigint;
    v_superseded jsonb := '[]'::jsonb;
    v_run durable_workflowrun;
BEGIN
    -- 1. and 2., one key at a time in key order.
    FOR q, i IN
        SELECT e.value, (e.ordinality - 1)::integer FROM jsonb_array_elements(p_quotas) WITH ORDINALITY AS e
         ORDER BY e.value->>'key' COLLATE "C"
    LOOP
        v_key := q->>'key';
        v_limit := (q->>'limit')::integer;
        v_statuses := ARRAY(SELECT jsonb_array_elements_text(q->'statuses'));
        SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = v_key FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO durable_concurrencylock (key, "limit", count_statuses, rr_cursor)
            VALUES (v_key, v_limit, q->'statuses', '') ON CONFLICT (key) DO NOTHING;
            SELECT l.limit_override INTO v_override FROM durable_concurrencylock l WHERE l.key = v_key FOR UPDATE;
        END IF;
        UPDATE durable_concurrencylock l SET "limit" = v_limit, count_statuses = q->'statuses'
         WHERE l.key = v_key AND (l."limit" IS DISTINCT FROM v_limit OR l.count_statuses <> q->'statuses');
        v_limits[i + 1] := COALESCE(v_override, v_limit);
        SELECT count(*) INTO v_count
          FROM durable_counted_tags(ARRAY['concurrency:' || v_key], v_statuses, p_count_namespace) AS t;
        v_active[i + 1] := v_count;
        v_count := 0;
        IF q->>'strategy' IN ('group_round_robin', 'cancel_queued_except_newest', 'cancel_queued_except_oldest') THEN
            SELECT count(*) INTO v_count FROM durable_runtag t
             WHERE t.tag = 'concurrency:' || v_key AND t.status = 'queued'
               AND (p_count_namespace IS NULL OR t.namespace = p_count_namespace);
        END IF;
        v_queued[i + 1] := v_count;
    END LOOP;

    -- 3. In quota order: the refusals any strategy makes.
    FOR j IN 0 .. n - 1 LOOP
        i := j;
        q := p_quotas->i;
        v_key := q->>'key';
        v_limit := v_limits[i + 1];
        IF v_limit <= 0 OR (q->>'strategy' = 'reject' AND v_active[i + 1] >= v_limit) THEN
            v_outcome := 'full';
            v_reason := 'limit';
            EXIT;
        END IF;
        IF v_active[i + 1] >= v_limit THEN
            v_statuses := ARRAY(
                SELECT s FROM jsonb_array_elements_text(q->'statuses') AS s
                 WHERE s IN ('completed', 'failed', 'cancelled', 'dead'));
            IF cardinality(v_statuses) > 0 THEN
                SELECT count(*) INTO v_finished
                  FROM durable_counted_tags(ARRAY['concurrency:' || v_key], v_statuses, p_count_namespace) AS t;
                IF v_finished >= v_limit THEN
                    v_outcome := 'full';
                    v_reason := 'lifetime';
                    EXIT;
                END IF;
            END IF;
        END IF;
        IF v_active[i + 1] >= v_limit OR v_queued[i + 1] > 0 THEN
            v_status := 'queued';  -- only the keys of a queueing strategy get here
        END IF;
    END LOOP;

    -- A CANCEL_QUEUED_EXCEPT_OLDEST key whose queue is full: created cancelled, in quota order.
    IF v_outcome IS NULL AND v_status = 'queued' THEN
        FOR j IN 0 .. n - 1 LOOP
            q := p_quotas->j;
            CONTINUE WHEN q->>'strategy' <> 'cancel_queued_except_oldest'
                       OR (v_active[j + 1] < v_limits[j + 1] AND v_queued[j + 1] = 0)
                       OR v_queued[j + 1] < COALESCE((q->>'max_queued')::integer, 1);
            v_status := 'cancelled';
            v_finished_at := now();
            v_error := jsonb_build_object(
                'type', 'durable.cancel_queued_except_oldest',
                'message', 'Cancelled at start: the queue of concurrency key ' || (q->>'key') || ' was full ('
                    || v_queued[j + 1] || ' of max_queued=' || COALESCE(q->>'max_queued', 'None') || ' waiting, '
                    || v_active[j + 1] || ' of ' || v_limits[j + 1]
                    || ' in flight); CANCEL_QUEUED_EXCEPT_OLDEST keeps the runs queued first.',
                'key', q->>'key');
            EXIT;
        END LOOP;
    END IF;

    -- The refusals of a start that would be queued, in quota order over its full keys.
    IF v_outcome IS NULL AND v_status = 'queued' THEN
        FOR j IN 0 .. n - 1 LOOP
            i := j;
            q := p_quotas->i;
            v_key := q->>'key';
            v_limit := v_limits[i + 1];
            CONTINUE WHEN v_active[i + 1] < v_limit AND v_queued[i + 1] = 0;
            IF q->>'strategy' = 'group_round_robin' AND q->>'max_queued' IS NOT NULL
               AND v_queued[i + 1] >= (q->>'max_queued')::integer THEN
                v_outcome := 'queue_full';
                EXIT;
            END IF;
            IF v_active[i + 1] >= v_limit AND q->'statuses' ? 'suspended' THEN
                -- A child queued behind an ancestor holding a slot of this key could wait for it forever.
                SELECT a.value->>'run_id' INTO v_holder
                  FROM jsonb_array_elements(p_ancestors) WITH ORDINALITY AS a
                 WHERE q->'statuses' ? (a.value->>'status')
                   AND EXISTS (
                       SELECT 1 FROM durable_runtag t JOIN durable_workflowrun r ON r.id = t.run_id
                        WHERE r.run_id = a.value->>'run_id' AND t.tag = 'concurrency:' || v_key)
                 ORDER BY a.ordinality LIMIT 1;
                IF v_holder IS NOT NULL THEN
                    v_outcome := 'full';
                    v_reason := 'ancestor';
                    EXIT;
                END IF;
            END IF;
        END LOOP;
    END IF;

    -- The queued runs a CANCEL_QUEUED_EXCEPT_NEWEST start replaces, in quota order
    -- (a run picked for two keys is cancelled once, for the first).
    IF v_outcome IS NULL AND v_status = 'queued' THEN
        FOR j IN 0 .. n - 1 LOOP
            q := p_quotas->j;
            CONTINUE WHEN q->>'strategy' <> 'cancel_queued_except_newest'
                       OR v_queued[j + 1] < COALESCE((q->>'max_queued')::integer, 1);
            FOR v_victim IN
                SELECT r.id FROM durable_runtag t JOIN durable_workflowrun r ON r.id = t.run_id
                 WHERE t.tag = 'concurrency:' || (q->>'key') AND t.status = 'queued'
                   AND (p_count_namespace IS NULL OR t.namespace = p_count_namespace)
                 ORDER BY r.created_at, r.run_id COLLATE "C"
                 LIMIT v_queued[j + 1] - COALESCE((q->>'max_queued')::integer, 1) + 1
            LOOP
                CONTINUE WHEN v_victim = ANY (v_victims);
                v_victims := v_victims || v_victim;
                v_victim_errors := v_victim_errors || jsonb_build_array(q->'replaced_error');
            END LOOP;
        END LOOP;
    END IF;

    IF v_outcome IS NULL AND p_parent_run_id IS NOT NULL THEN
        SELECT r.id INTO v_parent FROM durable_workflowrun r WHERE r.run_id = p_parent_run_id;
    END IF;
    IF v_outcome IS NULL OR p_run_id_given THEN
        INSERT INTO durable_workflowrun (
            run_id, workflow, version, namespace, status, input, attempt, generation,
            lease, worker, queue, waiting_for, dispatched_at, parent_id, fenced, error, finished_at
        ) VALUES (
            p_run_id, p_workflow, p_version, p_namespace, v_status, p_input, 0, 0,
            '', '', p_queue, '', now(), v_parent, p_count_namespace IS NOT NULL, v_error, v_finished_at
        ) ON CONFLICT (run_id) DO NOTHING
        RETURNING id INTO v_pk;
        IF v_pk IS NULL THEN
            RETURN QUERY SELECT 'exists'::text, NULL::text, NULL::text, NULL::integer, NULL::bigint, NULL::bigint,
                                NULL::integer, NULL::text, NULL::text, NULL::jsonb,
                                NULL::double precision, NULL::jsonb, NULL::timestamp with time zone, NULL::jsonb;
            RETURN;
        END IF;
    END IF;
    IF v_outcome IS NOT NULL THEN
        IF v_pk IS NOT NULL THEN
            DELETE FROM durable_workflowrun r WHERE r.id = v_pk;  -- the probe of a given run id
        END IF;
        IF v_limit > 0 AND (v_outcome = 'queue_full' OR v_reason = 'limit') THEN
            -- The estimate of Retry-After, as durable_admit makes it.
            v_statuses := ARRAY(SELECT jsonb_array_elements_text(q->'statuses'));
            SELECT (SELECT l.recent_durations FROM durable_concurrencylock l WHERE l.key = v_key),
                   extract(epoch FROM now() - min(t.created_at))
              INTO v_durations, v_oldest_age
              FROM durable_counted_tags(ARRAY['concurrency:' || v_key], v_statuses, p_count_namespace) AS t;
        END IF;
        RETURN QUERY SELECT v_outcome, NULL::text, v_key, v_limit, v_active[i + 1], v_queued[i + 1],
                            (q->>'max_queued')::integer, v_reason, v_holder, v_durations, v_oldest_age,
                            NULL::jsonb, NULL::timestamp with time zone, NULL::jsonb;
        RETURN;
    END IF;

    -- 4.
    INSERT INTO durable_runtag (run_id, tag, status, namespace, group_key)
    SELECT v_pk, 'concurrency:' || (e->>'key'), v_status, p_namespace, e->>'group'
      FROM jsonb_array_elements(p_quotas) AS e;
    IF v_status = 'pending' THEN
        UPDATE durable_concurrencylock l SET rr_cursor = e->>'group'
          FROM jsonb_array_elements(p_quotas) AS e
         WHERE l.key = e->>'key' AND e->>'strategy' = 'group_round_robin';
    END IF;
    FOR j IN 1 .. cardinality(v_victims) LOOP
        UPDATE durable_workflowrun r
           SET status = 'cancelled', updated_at = now(), lease = '', waiting_for = '', wake_at = NULL,
               error = v_victim_errors->(j - 1), finished_at = now()
         WHERE r.id = v_victims[j] AND r.status IN ('pending', 'queued', 'running', 'suspended', 'blocked')
        RETURNING r.* INTO v_run;
        CONTINUE WHEN NOT FOUND;  -- cancelled meanwhile: it left the queue already
        UPDATE durable_runtag t SET status = 'cancelled' WHERE t.run_id = v_run.id;
        v_superseded := v_superseded || jsonb_build_array(to_jsonb(v_run) || jsonb_build_object(
            'parent_run_id', (SELECT p.run_id FROM durable_workflowrun p WHERE p.id = v_run.parent_id)));
    END LOOP;
    RETURN QUERY SELECT 'created'::text, v_status, NULL::text, NULL::integer, NULL::bigint, NULL::bigint,
                        NULL::integer, NULL::text, NULL::text, NULL::jsonb, NULL::double precision,
                        v_error, v_finished_at, v_superseded;
END;
$$;

-- durable_promote: hand the free slots of keys to their queued runs, as
-- admission.Promoter.promote does, in one round trip.
--
-- p_keys: the keys, in the order to serve them ([] for none); p_run_id: a run
--   that left its slots (finished, suspended, blocked): its keys are served after
--   p_keys, read here from its tags.
-- p_count_namespace: the namespace slots are counted and queues read in (NULL: all).
-- p_lock_first: keys to lock, in key order, before anything else (a retry).
-- Returns {"started": [the runs made pending, each as a row of durable_workflowrun
--   with "parent_run_id"], "retry": null, or the keys to lock first in a new call}.
--
-- For each key, while it has room: its queued runs' heads (the oldest queued run
-- of each group) in round-robin order, the groups after the key's rr_cursor
-- first; the first head whose every key has room, counted under those keys'
-- locks, is made pending (status mirrored on its tags, dispatched_at and
-- redispatches reset, as DjangoStore.transition does) and the cursor moves to
-- its group. A head that waits for another key full is skipped; one that another
-- promoter took meanwhile makes it read the heads again. A key is left as soon as
-- it is full, or when the hand-off took its last free slot (the promote of the
-- run that frees the next one hands that on).
--
-- p_async_commit: commit the call's own transaction without waiting for its WAL
-- to reach the disk (synchronous_commit off, for this transaction only; the
-- caller passes it only when the call is a transaction of its own). A hand-off
-- that a crash of the database loses right after it is lost whole: its run is
-- queued again, and the sweeper hands it the slot. Nothing that saw it can
-- survive it either: a later synchronous commit flushes the WAL before its own.
-- A key with no queued run costs one read and takes no lock. Locks are held
-- until the call ends: a lock is waited for only when its key sorts after every
-- key this call holds; another one is only tried (SKIP LOCKED), and if it is
-- busy the call stops and answers "retry" with the keys to take first next time.
CREATE OR REPLACE FUNCTION durable_promote(
    p_keys jsonb,
    p_run_id text,
    p_count_namespace text,
    p_lock_first jsonb,
    p_now timestamp with time zone,
    p_async_commit boolean
) RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_keys text[];
    v_key text;
    v_tag text;
    v_held text[] := '{}';
    v_started jsonb := '[]'::jsonb;
    v_limit integer;
    v_statuses text[];
    v_count bigint;
    v_cursor text;
    v_head record;
    v_run_keys text[];
    v_other text;
    v_room bigint;
    v_blocked text;
    v_gone boolean;
    v_moved boolean;
    v_run durable_workflowrun;
    v_rounds integer;
BEGIN
    v_keys := ARRAY(SELECT jsonb_array_elements_text(COALESCE(p_keys, '[]'::jsonb)));
    IF p_run_id IS NOT NULL THEN
        v_keys := v_keys || ARRAY(
            SELECT substr(t.tag, 13) FROM durable_runtag t JOIN durable_workflowrun r ON r.id = t.run_id
             WHERE r.run_id = p_run_id AND left(t.tag, 12) = 'concurrency:'
             ORDER BY substr(t.tag, 13) COLLATE "C");
    END IF;
    FOR v_other IN
        SELECT d.k FROM (SELECT DISTINCT k FROM jsonb_array_elements_text(COALESCE(p_lock_first, '[]'::jsonb)) AS k) AS d
         ORDER BY d.k COLLATE "C"
    LOOP
        PERFORM 1 FROM durable_concurrencylock l WHERE l.key = v_other FOR UPDATE;
        v_held := v_held || v_other;
    END LOOP;

    FOR v_key IN SELECT k FROM unnest(v_keys) WITH ORDINALITY AS u(k, o) GROUP BY k ORDER BY min(o) LOOP
        v_tag := 'concurrency:' || v_key;
        v_rounds := 0;
        <<handoffs>>
        LOOP
            v_rounds := v_rounds + 1;
            EXIT WHEN v_rounds > 10000;  -- a backstop, as Promoter's MAX_HANDOFFS
            EXIT handoffs WHEN NOT EXISTS (
                SELECT 1 FROM durable_runtag t
                 WHERE t.tag = v_tag AND t.status = 'queued'
                   AND (p_count_namespace IS NULL OR t.namespace = p_count_namespace));
            -- Full by a count without its lock: reliable, as each run it counted
            -- promotes on its own release (see Promoter._full).
            SELECT COALESCE(l.limit_override, l."limit"), ARRAY(SELECT jsonb_array_elements_text(l.count_statuses)),
                   l.rr_cursor
              INTO v_limit, v_statuses, v_cursor
              FROM durable_concurrencylock l WHERE l.key = v_key;
            IF v_limit IS NOT NULL AND cardinality(v_statuses) > 0 THEN
                SELECT count(*) INTO v_count
                  FROM durable_counted_tags(ARRAY[v_tag], v_statuses, p_count_namespace) AS t;
                EXIT handoffs WHEN v_count >= v_limit;
            END IF;
            v_cursor := COALESCE(v_cursor, '');
            v_gone := false;
            v_moved := false;
            FOR v_head IN
                SELECT h.group_key, h.run_pk FROM (
                    SELECT DISTINCT ON (t.group_key COLLATE "C") t.group_key, t.run_id AS run_pk
                      FROM durable_runtag t
                     WHERE t.tag = v_tag AND t.status = 'queued'
                       AND (p_count_namespace IS NULL OR t.namespace = p_count_namespace)
                     ORDER BY t.group_key COLLATE "C", t.id) AS h
                 ORDER BY h.group_key COLLATE "C" <= v_cursor COLLATE "C", h.group_key COLLATE "C"
            LOOP
                -- Lock every key of the run that has a quota, in key order.
                v_run_keys := ARRAY(
                    SELECT l.key FROM durable_runtag t JOIN durable_concurrencylock l
                        ON l.key = substr(t.tag, 13)
                     WHERE t.run_id = v_head.run_pk AND left(t.tag, 12) = 'concurrency:'
                       AND COALESCE(l.limit_override, l."limit") IS NOT NULL
                       AND jsonb_array_length(l.count_statuses) > 0
                     ORDER BY l.key COLLATE "C");
                FOREACH v_other IN ARRAY v_run_keys LOOP
                    CONTINUE WHEN v_other = ANY (v_held);
                    IF cardinality(v_held) = 0
                       OR v_other COLLATE "C" > (SELECT max(h COLLATE "C") FROM unnest(v_held) AS h) THEN
                        PERFORM 1 FROM durable_concurrencylock l WHERE l.key = v_other FOR UPDATE;
                    ELSE
                        PERFORM 1 FROM durable_concurrencylock l WHERE l.key = v_other FOR UPDATE SKIP LOCKED;
                        IF NOT FOUND THEN
                            -- Waiting here could deadlock: stop, and take it first in a new call.
                            RETURN jsonb_build_object(
                                'started', v_started,
                                'retry', to_jsonb(ARRAY(SELECT DISTINCT unnest(v_held || v_run_keys))));
                        END IF;
                    END IF;
                    v_held := v_held || v_other;
                END LOOP;
                -- Count every key under its lock.
                v_blocked := NULL;
                v_room := NULL;
                FOREACH v_other IN ARRAY v_run_keys LOOP
                    SELECT COALESCE(l.limit_override, l."limit"), ARRAY(SELECT jsonb_array_elements_text(l.count_statuses))
                      INTO v_limit, v_statuses
                      FROM durable_concurrencylock l WHERE l.key = v_other;
                    SELECT count(*) INTO v_count
                      FROM durable_counted_tags(ARRAY['concurrency:' || v_other], v_statuses, p_count_namespace) AS t;
                    IF v_count >= v_limit THEN
                        v_blocked := v_other;
                        EXIT;
                    END IF;
                    IF v_other = v_key THEN
                        v_room := v_limit - v_count;
                    END IF;
                END LOOP;
                IF v_blocked = v_key THEN
                    EXIT handoffs;  -- the key is full
                END IF;
                CONTINUE WHEN v_blocked IS NOT NULL;  -- it waits for another key
                IF p_async_commit AND jsonb_array_length(v_started) = 0 THEN
                    PERFORM set_config('synchronous_commit', 'off', true);
                END IF;
                UPDATE durable_workflowrun r
                   SET status = 'pending', updated_at = p_now, dispatched_at = p_now, redispatches = 0
                 WHERE r.id = v_head.run_pk AND r.status = 'queued'
                RETURNING r.* INTO v_run;
                IF NOT FOUND THEN
                    v_gone := true;  -- another promoter took it, or it was cancelled
                    CONTINUE;
                END IF;
                UPDATE durable_runtag t SET status = 'pending' WHERE t.run_id = v_run.id;
                UPDATE durable_concurrencylock l SET rr_cursor = v_head.group_key WHERE l.key = v_key;
                v_started := v_started || jsonb_build_array(to_jsonb(v_run) || jsonb_build_object(
                    'parent_run_id', (SELECT p.run_id FROM durable_workflowrun p WHERE p.id = v_run.parent_id)));
                v_moved := true;
                EXIT handoffs WHEN v_room = 1;  -- it took the key's last free slot
                EXIT;  -- read the heads again for the next hand-off
            END LOOP;
            EXIT handoffs WHEN NOT v_moved AND NOT v_gone;  -- every head waits for another key
        END LOOP;
    END LOOP;
    RETURN jsonb_build_object('started', v_started, 'retry', NULL);
END;
$$;
