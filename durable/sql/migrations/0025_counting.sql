-- durable_counted_tags: the tag rows that a quota counts, read so that a key's
-- finished runs cost nothing (PostgreSQL). Installed by migration 0025; a change
-- here needs a new file in durable/sql/migrations/ and a migration that runs it.
--
-- p_tags: the tags ('concurrency:<key>', 'borrowed:<key>'); p_statuses: the
-- quota's count_statuses; p_namespace: the namespace counted, NULL for every one.
-- Returns the tag and created_at of each tag row of p_tags in p_statuses.
--
-- Why a function: durable's functions run with generic plans (force_generic_plan,
-- or the cached plans of PL/pgSQL), where p_statuses is an unknown array, so
-- PostgreSQL does not know it picks few rows: it read every tag entry of the key,
-- finished runs included, and filtered on the status (about 5 ms a start on a key
-- with 5,000 finished runs, measured, and more as its history grew). Here the
-- statuses of the partial index durable_tag_slot_idx (the default count_statuses,
-- DEFAULT_CONCURRENCY_STATUSES) are written out: when p_statuses are among them
-- (the default and every narrower list), the first branch reads that index, which
-- holds no finished run; else the second reads durable_tag_count_idx, as counting
-- a terminal status (a lifetime cap) must. The branch not taken is not run: its
-- condition is on the arguments alone (a one-time filter).
--
-- LANGUAGE sql, STABLE, one SELECT, neither STRICT nor SET: PostgreSQL inlines it
-- into the statement that calls it from its FROM clause, which then plans and runs
-- as if the query were written there, in that statement's snapshot.
CREATE OR REPLACE FUNCTION durable_counted_tags(p_tags text[], p_statuses text[], p_namespace text)
RETURNS TABLE (tag character varying, created_at timestamp with time zone)
LANGUAGE sql STABLE AS $$
    SELECT t.tag, t.created_at FROM durable_runtag t
     WHERE p_statuses <@ '{pending,running,suspended,blocked}'::text[]
       AND t.status IN ('pending', 'running', 'suspended', 'blocked')
       AND t.tag = ANY (p_tags) AND t.status = ANY (p_statuses)
       AND (p_namespace IS NULL OR t.namespace = p_namespace)
    UNION ALL
    SELECT t.tag, t.created_at FROM durable_runtag t
     WHERE NOT p_statuses <@ '{pending,running,suspended,blocked}'::text[]
       AND t.tag = ANY (p_tags) AND t.status = ANY (p_statuses)
       AND (p_namespace IS NULL OR t.namespace = p_namespace)
$$;
