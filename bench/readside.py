"""Section (h): the read side. Each list of the HTTP API and of the admin, read with
Django's test client, with a small history and then with a big one.

Two scratch databases get ``SMALL_RUNS`` runs on ``SMALL_RUNS / RUNS_PER_KEY`` keys
(every ``RUNNING_EVERY``-th running, the rest completed); the second then grows to
``finished_runs`` runs on ``finished_runs / RUNS_PER_KEY`` keys (the new runs all
completed and newer, so the running ones end up buried under them). Each list is
timed in both, back to back, in ``ROUNDS`` rounds; its ratio is the median of the
rounds' ratios, as in the other sections. Target: every list at most 1.2x its
time with the small history.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from django.db import connections
from psycopg.types.json import Jsonb

from bench import history
from bench import report as _report
from bench import scratch as scratch_mod
from bench.report import Report
from bench.scratch import Scratch
from bench.sections import Options, Progress
from durable.status import DEFAULT_CONCURRENCY_STATUSES

SMALL_RUNS = 1000
RUNS_PER_KEY = 10
#: Runs among the first SMALL_RUNS left running (every RUNNING_EVERY-th).
RUNNING_EVERY = 50
TARGET = 1.2
#: Durable's rows (the other sections write into the main database first).
_EMPTY = (
    "TRUNCATE durable_workflowrun, durable_runtag, durable_concurrencylock, durable_steprecord, durable_signal, "
    "durable_schedule RESTART IDENTITY CASCADE"
)
#: Rounds per list. With 3 rounds and the ratio of the two best times, one slow
#: spell of the machine turned an unchanged list into a miss (the admin's quota
#: list read 1.61x in a full run, 0.93-1.13x in scratch runs of the same pages);
#: 7 rounds still read one unchanged list at 1.22x in a full run (its 5 queries
#: took 1 ms each in both databases).
ROUNDS = 11

#: (label, URL): the lists measured, then the one-key detail for comparison.
LISTS = (
    ("API GET runs/", "/durable/runs/"),
    ("API GET runs/?status=completed", "/durable/runs/?status=completed"),
    ("API GET runs/?status=running", "/durable/runs/?status=running"),
    ("API GET quotas/", "/durable/quotas/"),
    ("API GET quotas/<key>/", "/durable/quotas/k7/"),
    ("admin run list", "/admin/durable/workflowrun/"),
    ("admin run list, running", "/admin/durable/workflowrun/?status__exact=running"),
    ("admin quota list", "/admin/durable/concurrencylock/"),
)


def section_h(opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    """Every list's time with ``finished_runs`` runs against ``SMALL_RUNS`` runs."""
    big = opts.finished_runs
    if big <= SMALL_RUNS:
        report.target("h", "every list, big/small history", f"<= {TARGET}x", None, None, "-", "--finished-runs too small")
        return
    small_db, big_db = f"{opts.db_name}_h0", f"{opts.db_name}_h1"
    for name in (small_db, big_db):
        # Copies of the migrated main database, emptied of what other sections wrote.
        connections["default"].close()
        scratch_mod.add_copy(scratch, name)
        with psycopg.connect(scratch.conninfo(name)) as conn:
            conn.execute(_EMPTY)
    t0_at = datetime.now(tz=UTC) - timedelta(milliseconds=big + 1000)
    progress(f"(h) loading {SMALL_RUNS:,} runs on {SMALL_RUNS // RUNS_PER_KEY:,} keys into {small_db} and {big_db}")
    for name in (small_db, big_db):
        load(scratch.conninfo(name), 1, SMALL_RUNS, SMALL_RUNS // RUNS_PER_KEY, t0_at)
    progress(f"(h) growing {big_db} to {big:,} runs on {big // RUNS_PER_KEY:,} keys")
    started = time.perf_counter()
    load(scratch.conninfo(big_db), SMALL_RUNS + 1, big, big // RUNS_PER_KEY, t0_at)
    for name in (small_db, big_db):
        history.vacuum_analyze(scratch.conninfo(name))
    progress(f"(h) loaded in {time.perf_counter() - started:.0f} s; measuring")
    timings = _measure(small_db, big_db)
    note = "" if big >= 1_000_000 else f"(--quick or --finished-runs: {big:,} runs, not 1,000,000)"
    for label, _url in LISTS:
        smalls, larges = zip(*timings[label], strict=True)
        ratio = _report.median([large / small for small, large in timings[label]])
        report.row(
            "h",
            f"{label}, {big:,} runs vs {SMALL_RUNS:,}",
            _report.ratio(ratio),
            f"median of {len(smalls)} rounds; p50 {_report.median(larges) * 1000:.1f} ms "
            f"vs {_report.median(smalls) * 1000:.1f} ms",
        )
        report.target("h", f"{label}, big/small history", f"<= {TARGET}x", ratio, ratio <= TARGET, _report.ratio(ratio), note)


def load(conninfo: str, first: int, last: int, keys: int, t0: datetime) -> None:
    """Runs ``first``..``last`` (run ``g`` created ``g`` ms after ``t0``, on key ``k<g % keys>``)
    with their tags, and the lock rows of keys ``k0``..``k<keys - 1>``."""
    from durable import models

    runs = history._insert_select(
        models.WorkflowRun,
        {
            "run_id": "'read-' || g",
            "workflow": "'bench.read'",
            "version": "'1'",
            "namespace": "'default'",
            "status": f"CASE WHEN g <= {SMALL_RUNS} AND g %% {RUNNING_EVERY} = 0 THEN 'running' ELSE 'completed' END",
            "input": "jsonb_build_object('key', 'k' || (g %% %(keys)s))",
            "attempt": "1",
            "worker": "'bench'",
            **{name: "ts.t" for name in ("heartbeat_at", "dispatched_at", "created_at", "updated_at", "started_at")},
            "finished_at": f"CASE WHEN g <= {SMALL_RUNS} AND g %% {RUNNING_EVERY} = 0 THEN NULL ELSE ts.t END",
        },
        "FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g "
        "CROSS JOIN LATERAL (SELECT %(t0)s::timestamptz + make_interval(secs => g / 1000.0) AS t) AS ts",
    )
    tags = history._insert_select(
        models.RunTag,
        {
            "run": "r.id",
            "tag": "'concurrency:' || (r.input ->> 'key')",
            "status": "r.status",
            "namespace": "r.namespace",
            "created_at": "r.created_at",
        },
        f"FROM {models.WorkflowRun._meta.db_table} AS r "
        "WHERE r.run_id LIKE 'read-%%' AND r.id > (SELECT COALESCE(MAX(run_id), 0) FROM durable_runtag)",
    )
    locks = history._insert_select(
        models.ConcurrencyLock,
        {"key": "'k' || k", "limit": "10", "count_statuses": "%(statuses)s"},
        "FROM generate_series(0, %(keys)s::bigint - 1) AS k ON CONFLICT DO NOTHING",
    )
    params = {"first": first, "last": last, "keys": keys, "t0": t0, "statuses": Jsonb(list(DEFAULT_CONCURRENCY_STATUSES))}
    with psycopg.connect(conninfo) as conn:
        for sql, defaults in (runs, tags, locks):
            conn.execute(sql, {**params, **defaults})


def _measure(small_db: str, big_db: str) -> dict[str, list[tuple[float, float]]]:
    """Seconds of each list's GET in the small and the big database, one pair per round.

    One connection to each database stays open and Django's ``default`` alias
    switches between them request by request: the two databases alternate
    (the first of a round is the second of the next), so a change in the
    machine's load weighs on both alike. Each URL is read once untimed first.
    """
    timings: dict[str, list[tuple[float, float]]] = {}
    with _connections([small_db, big_db]) as wrappers:
        clients = []
        for wrapper in wrappers:
            connections["default"] = wrapper
            clients.append(_client())
        for label, url in LISTS:
            for wrapper, client in zip(wrappers, clients, strict=True):
                connections["default"] = wrapper
                _get(client, url)
            for round_ in range(ROUNDS):
                pair = [0.0, 0.0]
                for index in (0, 1) if round_ % 2 == 0 else (1, 0):
                    connections["default"] = wrappers[index]
                    started = time.perf_counter()
                    _get(clients[index], url)
                    pair[index] = time.perf_counter() - started
                timings.setdefault(label, []).append((pair[0], pair[1]))
    return timings


def _get(client: Any, url: str) -> None:
    response = client.get(url)
    if response.status_code != 200:
        raise RuntimeError(f"(h) GET {url} answered {response.status_code}: {response.content[:300]!r}")


def _client() -> Any:
    """A test client logged in as a superuser (the admin, and the API's session authentication)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    user, created = get_user_model().objects.get_or_create(
        username="bench-reader", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    return client


@contextlib.contextmanager
def _connections(names: list[str]) -> Iterator[list[Any]]:
    """A connection of Django's ``default`` alias to each of ``names``; the alias is restored at the end."""
    original = connections["default"]
    wrappers = [type(original)({**original.settings_dict, "NAME": name}, "default") for name in names]
    try:
        yield wrappers
    finally:
        for wrapper in wrappers:
            wrapper.close()
        connections["default"] = original
