"""Section (c)'s history: many finished runs bulk-loaded with ``INSERT ... SELECT generate_series``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench import schema, starters
from durable.status import DEFAULT_CONCURRENCY_STATUSES

#: The tag COUNT of an admission, as ``DjangoStore.count_runs`` sends it.
COUNT = "SELECT COUNT(*) FROM durable_runtag WHERE tag = %s AND status = ANY(%s)"


def load_finished(conninfo: str, n: int, measured_keys: int) -> None:
    """``n`` completed runs with their tags and lock rows.

    Keys are ``c-k0`` .. ``c-k<2 * measured_keys - 1>``: half the runs are on the
    keys that section (c) starts on, half on other keys.
    """
    from durable import models

    keys = 2 * measured_keys
    runs = _insert_select(
        models.WorkflowRun,
        {
            "run_id": "'finished-' || g",
            "workflow": "%(workflow)s",
            "version": "%(version)s",
            "namespace": "'default'",
            "status": "'completed'",
            "input": "jsonb_build_object('key', 'c-k' || (g %% %(keys)s))",
            "attempt": "1",
            "worker": "'bench'",
            **{
                name: "ts.t"
                for name in ("heartbeat_at", "dispatched_at", "created_at", "updated_at", "started_at", "finished_at")
            },
        },
        "FROM generate_series(1, %(n)s) AS g "
        "CROSS JOIN LATERAL (SELECT now() - make_interval(secs => (%(n)s - g) / 100.0) AS t) AS ts",
    )
    tags = _insert_select(
        models.RunTag,
        {
            "run": "r.id",
            "tag": "'concurrency:' || (r.input ->> 'key')",
            "status": "r.status",
            "namespace": "r.namespace",
            "created_at": "r.created_at",
        },
        f"FROM {models.WorkflowRun._meta.db_table} AS r WHERE r.run_id LIKE 'finished-%%'",
    )
    locks = _insert_select(
        models.ConcurrencyLock,
        {"key": "'c-k' || k", "limit": "%(limit)s", "count_statuses": "%(statuses)s"},
        "FROM generate_series(0, %(keys)s - 1) AS k ON CONFLICT DO NOTHING",
    )
    params = {
        "workflow": starters.WORKFLOW,
        "version": starters.VERSION,
        "keys": keys,
        "n": n,
        "limit": starters.RATE_LIMIT,
        "statuses": Jsonb(list(DEFAULT_CONCURRENCY_STATUSES)),
    }
    with psycopg.connect(conninfo) as conn:
        for sql, defaults in (runs, tags, locks):
            conn.execute(sql, {**params, **defaults})


def _insert_select(model: Any, exprs: Mapping[str, str], tail: str) -> tuple[str, dict[str, Any]]:
    """``INSERT INTO <table> (<Django's insert columns>) SELECT <exprs or defaults> <tail>``."""
    fields = schema.insert_fields(model, exprs)
    defaults = {f"default_{f.name}": schema.default_param(f) for f in fields if f.name not in exprs}
    values = [exprs.get(f.name, f"%(default_{f.name})s") for f in fields]
    columns = ", ".join(schema.column(f) for f in fields)
    return f"INSERT INTO {model._meta.db_table} ({columns}) SELECT {', '.join(values)} {tail}", defaults


def vacuum_analyze(conninfo: str) -> None:
    """VACUUM (ANALYZE) durable's tables: statistics, and the visibility map an old table has."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) durable_workflowrun, durable_runtag, durable_concurrencylock")


def count_plan(conninfo: str, key: str, repeat: int = 5) -> str:
    """The plan of the admission COUNT for ``key`` in one line, with its median execution time."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return _explained(conn, COUNT, ("concurrency:" + key, list(DEFAULT_CONCURRENCY_STATUSES)), repeat)


def function_count_plan(conninfo: str, key: str, repeat: int = 5) -> str:
    """The same for the count that durable's SQL functions make (``durable_counted_tags``,
    planned generically as in them), in one line."""
    # Client-side binding: EXECUTE takes its arguments as literals.
    with psycopg.connect(conninfo, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute("PREPARE bench_count(text[], text[]) AS SELECT count(*) FROM durable_counted_tags($1, $2, NULL)")
        return _explained(
            conn, "EXECUTE bench_count(%s, %s)", (["concurrency:" + key], list(DEFAULT_CONCURRENCY_STATUSES)), repeat
        )


def _explained(conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...], repeat: int) -> str:
    times: list[float] = []
    lines: list[str] = []
    for _ in range(repeat):
        rows = conn.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) " + sql, params).fetchall()
        lines = [str(r[0]).strip().removeprefix("->").strip() for r in rows]
        total = next((line for line in lines if line.startswith("Execution Time")), "")
        if total:
            times.append(float(total.split(":")[1].split()[0]))
    executed = [line for line in lines if " on " in line and "never executed" not in line]
    scan = next((line.split("(actual")[0].strip() for line in executed if " on durable_runtag" in line), "?")
    # The entries read and dropped: the key's finished runs, unless the index holds none.
    removed = sum(int(line.split(":")[1]) for line in lines if line.startswith("Rows Removed by Filter"))
    fetches = next((line for line in lines if line.startswith("Heap Fetches")), "")
    median = sorted(times)[len(times) // 2] if times else float("nan")
    parts = (scan, f"{removed:,} entries read and filtered out", fetches, f"execution {median:.3f} ms (median of {len(times)})")
    return "; ".join(part for part in parts if part)


#: The finished runs of the key measured by ``key_history_latency`` in a full run.
KEY_HISTORY = 5_000
#: A call of ``durable_admit`` on one key (``%s``: the quotas, the run id).
ADMIT = "SELECT outcome FROM durable_admit(%s::jsonb, NULL, %s, 'bench', '1', 'default', '{}'::jsonb, NULL, '', false)"


def key_history_latency(conninfo: str, history: int, calls: int) -> dict[str, dict[str, list[float]]]:
    """``durable_admit``'s time (µs, as the client sees it) for a refusal and for an
    admitted start (rolled back, so every call finds the same key), on a key with
    ``history`` finished runs that no VACUUM has visited (a tenant's recent history)
    and on a key without any; the four kinds interleaved, ``calls`` each.

    Returns {"refusal" | "start": {"history" | "none": [µs, ...]}}.
    """
    from durable import models

    tag = uuid.uuid4().hex[:8]
    keys = {
        ("refusal", "history"): f"{tag}-refused-history",
        ("refusal", "none"): f"{tag}-refused-none",
        ("start", "history"): f"{tag}-started-history",
        ("start", "none"): f"{tag}-started-none",
    }
    runs = _insert_select(
        models.WorkflowRun,
        {"run_id": "%(prefix)s || g", "workflow": "'bench'", "version": "'1'", "status": "%(status)s", "attempt": "1"},
        "FROM generate_series(1, %(count)s) AS g",
    )
    tags = _insert_select(
        models.RunTag,
        {"run": "r.id", "tag": "'concurrency:' || %(key)s", "status": "r.status", "namespace": "r.namespace"},
        f"FROM {models.WorkflowRun._meta.db_table} AS r WHERE r.run_id LIKE %(prefix)s || '%%'",
    )
    statuses = list(DEFAULT_CONCURRENCY_STATUSES)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for (kind, past), key in keys.items():
            rows = [("completed", history)] if past == "history" else []
            rows += [("running", 2)] if kind == "refusal" else []
            for status, count in rows:
                params = {"key": key, "prefix": f"{key}-{status}-", "status": status, "count": count}
                for sql, defaults in (runs, tags):
                    conn.execute(sql, {**params, **defaults})
        # Statistics as autovacuum's ANALYZE keeps them (a table of mostly finished runs),
        # the pages not vacuumed: a tenant's recent history.
        conn.execute("ANALYZE durable_workflowrun, durable_runtag")
        quotas = {
            k: Jsonb([{"key": key, "limit": 2 if k[0] == "refusal" else 1_000_000, "statuses": statuses, "group": ""}])
            for k, key in keys.items()
        }
        times: dict[str, dict[str, list[float]]] = {kind: {"history": [], "none": []} for kind in ("refusal", "start")}
        order = list(quotas.items())
        for i in range(calls + 10):  # the first 10 of each warm the backend's caches and plans
            for (kind, past), payload in order[i % 4 :] + order[: i % 4]:  # each kind in each place in turn
                t0 = time.perf_counter()
                if kind == "refusal":  # one statement, which writes nothing
                    [outcome] = conn.execute(ADMIT, (payload, f"{tag}-{i}")).fetchone()
                else:
                    with conn.transaction(force_rollback=True):
                        [outcome] = conn.execute(ADMIT, (payload, f"{tag}-{i}")).fetchone()
                elapsed = (time.perf_counter() - t0) * 1e6
                assert outcome == ("full" if kind == "refusal" else "created"), outcome
                if i >= 10:
                    times[kind][past].append(elapsed)
    return times
