"""Sections (d) slot hand-off latency with a real Celery worker, (e) ``GROUP_ROUND_ROBIN`` admission."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import psycopg

from bench import report as _report
from bench import starters
from bench.broker import broker_app, delete_queue, purge, reach
from bench.celery_worker import CeleryWorker
from bench.pool import WorkerError, WorkerPool
from bench.report import Report
from bench.scratch import Scratch
from bench.sections import Options, Progress

#: Limit of every key of (d) and (e): the runs of a key form one chain of hand-offs.
LIMIT = 1


# -- (d) ------------------------------------------------------------------------
#: The worker's database connections, measured one after the other: (name, DATABASE_URL query, what it is).
WORKER_DATABASES = (
    (
        "per task",
        "",
        "Django's default settings (no pool, CONN_MAX_AGE 0): Celery closes Django's connection around every task, "
        "so each task that queries opens a new one; durable's own statements run on the connection each worker "
        "thread keeps (KEEP_WORKER_CONNECTION, the default)",
    ),
    ("pooled", "?pool=true", "Django's psycopg connection pool (DATABASE_URL ...?pool=true)"),
)
#: An extra configuration of (f) and (g), reported without a target: the default settings with
#: KEEP_WORKER_CONNECTION off, so durable's statements too open a new connection per task.
DJANGO_CONNECTION = (
    "per task, KEEP_WORKER_CONNECTION off",
    "",
    "option: Django's default settings with KEEP_WORKER_CONNECTION False: durable's statements run on Django's "
    "connection, which Celery closes around every task (a new PostgreSQL backend per run)",
)
#: (f) and (g)'s configurations: the measured ones, then the extra one.
WITH_OPTION = (*WORKER_DATABASES, DJANGO_CONNECTION)
#: The worker's environment of each configuration (the test project's settings read it).
WORKER_ENV = {DJANGO_CONNECTION[0]: {"DURABLE_KEEP_WORKER_CONNECTION": "0"}}
TARGET_D = "slot hand-off latency p50 (Celery worker, Redis)"


def section_d(opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    """Queue runs on a few keys, let a real worker run them; time each hand-off.

    Twice, each time with a new worker, on keys of its own: once with the test
    project's database settings (the target), once with a connection pool.
    """
    from kombu.utils.url import maybe_sanitize_url

    n, nkeys = opts.handoffs, opts.handoff_keys
    queue = f"durable-bench-{os.getpid()}"
    app = broker_app(opts.broker)
    conninfo = scratch.conninfo(scratch.main)
    results: dict[str, _Chains] = {}
    described = ""
    reason = reach(app)
    if reason:
        app.close()
        progress(f"(d) left out: {reason}")
        report.row("d", "slot hand-off latency", "-", f"not run: {reason}")
        report.target("d", TARGET_D, "<= 50 ms", None, None, "-", reason)
        return
    try:
        for name, query, _ in WORKER_DATABASES:
            worker = CeleryWorker(
                broker=opts.broker,
                database_url=scratch.url(scratch.main) + query,
                queue=queue,
                pool="threads",
                concurrency=nkeys,
            )
            described = worker.describe()
            purge(app, queue)
            prefix = f"d-{name.replace(' ', '-')}-"
            progress(f"(d) {name}: queueing {n} runs on {nkeys} key(s), limit {LIMIT}, GROUP_ROUND_ROBIN")
            statuses = _enqueue(app, queue, n, [f"{prefix}k{j}" for j in range(nkeys)])
            if statuses != {"pending": nkeys, "queued": n - nkeys}:
                raise RuntimeError(f"(d) expected {nkeys} pending and {n - nkeys} queued runs, got {statuses}")
            progress(f"(d) {name}: starting a Celery worker ({described}); waiting for the {n} runs")
            with worker:
                _wait_finished(conninfo, prefix, n, worker, progress)
            results[name] = _chains(conninfo, prefix)
    finally:
        try:
            delete_queue(app, queue)
        finally:
            app.close()
    label = f"broker {maybe_sanitize_url(opts.broker)} ({opts.broker_source}); {described}"
    _report_d(report, results, n, nkeys, label)


class _Send:
    """Dispatch of the benchmark process: the run's id to ``queue`` once the start commits."""

    def __init__(self, app: Any, queue: str) -> None:
        self.app, self.queue = app, queue

    def __call__(self, engine: Any, run: Any) -> None:
        from durable import tasks

        run_id, task_id = run.run_id, tasks.task_id(run.run_id, run.generation)
        engine.store.on_commit(
            lambda: self.app.send_task(tasks.EXECUTE_TASK, args=(run_id,), task_id=task_id, queue=self.queue, serializer="json")
        )


def _enqueue(app: Any, queue: str, n: int, keys: list[str]) -> dict[str, int]:
    """Start ``n`` runs of the hand-off workflow round-robin on ``keys``: the first
    of each key is sent to the (not yet started) worker, the others are queued."""
    from bench import handoff
    from durable import DjangoStore, Engine
    from durable.runtime.registry import Registry

    engine = Engine(store=DjangoStore(), dispatch=_Send(app, queue), registry=Registry())
    engine.register(handoff.WORKFLOW, handoff.VERSION, handoff.body, handoff.CONCURRENCY)
    statuses = Counter(str(engine.start(handoff.WORKFLOW, {"key": keys[i % len(keys)]}).status) for i in range(n))
    return dict(statuses)


_PROGRESS = """
SELECT status, count(*) FROM durable_workflowrun WHERE workflow = %s AND input ->> 'key' LIKE %s GROUP BY status
"""


def _wait_finished(
    conninfo: str,
    prefix: str,
    n: int,
    worker: CeleryWorker,
    progress: Progress,
    stall: float = 60.0,
    *,
    workflow: str = "",
    section: str = "d",
) -> None:
    """Poll until the ``n`` runs (of ``workflow``, default the hand-off workflow) on
    keys ``prefix*`` are finished; raise if the worker dies or stops making progress."""
    from bench import handoff
    from durable.status import TERMINAL_STATUSES

    done, last_change, last_report = -1, time.monotonic(), time.monotonic()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while True:
            worker.check()
            rows = conn.execute(_PROGRESS, (workflow or handoff.WORKFLOW, prefix + "%")).fetchall()
            counts: dict[str, int] = {str(status): int(count) for status, count in rows}
            finished = sum(count for status, count in counts.items() if status in TERMINAL_STATUSES)
            if finished != done:
                done, last_change = finished, time.monotonic()
            if any(counts.get(k) for k in ("failed", "dead", "cancelled")):
                raise WorkerError(f"({section}) some hand-off runs did not complete: {counts}\n{worker.log_tail()}")
            if finished >= n:
                return
            now = time.monotonic()
            if now - last_change > stall:
                raise WorkerError(
                    f"({section}) no run finished for {stall:.0f} s ({finished} of {n} done, statuses {counts}); "
                    f"the worker's log:\n{worker.log_tail()}"
                )
            if now - last_report > 5:
                progress(f"({section}) {finished} of {n} runs finished")
                last_report = now
            time.sleep(0.1)


_TIMELINE = """
SELECT input ->> 'key', extract(epoch FROM finished_at)::float8, extract(epoch FROM started_at)::float8,
       (output ->> 'started')::float8
  FROM durable_workflowrun WHERE workflow = %s AND status = 'completed' AND input ->> 'key' LIKE %s
"""

#: Per key, its runs as (started_at, body start, finished_at) in seconds, in the order they ran.
_Chains = dict[str, list[tuple[float, float, float]]]


def _chains(conninfo: str, prefix: str) -> _Chains:
    from bench import handoff

    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(_TIMELINE, (handoff.WORKFLOW, prefix + "%")).fetchall()
    chains: _Chains = {}
    for key, finished, claimed, body in rows:
        chains.setdefault(str(key), []).append((float(claimed), float(body), float(finished)))
    for runs in chains.values():
        runs.sort(key=lambda r: r[1])
    return chains


def _report_d(report: Report, results: dict[str, _Chains], n: int, nkeys: int, label: str) -> None:
    chain = "one chain" if nkeys == 1 else f"{nkeys} chains in parallel"
    report.row(
        "d",
        "hand-offs per worker configuration",
        f"{n - nkeys:,}",
        f"{n} runs on {nkeys} key(s) ({chain}), limit {LIMIT}, GROUP_ROUND_ROBIN",
    )
    measured: dict[str, tuple[list[float], int]] = {}
    for name, _, what in WORKER_DATABASES:
        # Hand-off i -> i+1 on a key: run i finished (its finished_at), run i+1's body started.
        latency, to_claim, claim_to_body = [], [], []
        for runs in results[name].values():
            for (_, _, finished), (claimed, body, _) in zip(runs, runs[1:], strict=False):
                latency.append((body - finished) * 1e6)
                to_claim.append((claimed - finished) * 1e6)
                claim_to_body.append((body - claimed) * 1e6)
        latency.sort()
        overlaps = sum(1 for us in latency if us < 0)
        measured[name] = (latency, overlaps)
        if not latency:
            report.row("d", f"slot hand-off latency, {name}", "-", "no hand-off measured")
            continue
        report.row(
            "d",
            f"slot hand-off latency p50 / p99, {name}",
            f"{_report.ms(_report.percentile(latency, 50))} / {_report.ms(_report.percentile(latency, 99))}",
            f"{len(latency)} hand-offs, max {_report.ms(latency[-1])}; {what}",
        )
        report.row(
            "d",
            f"  p50 finished -> claimed / claimed -> body, {name}",
            f"{_report.ms(_report.median(to_claim))} / {_report.ms(_report.median(claim_to_body))}",
            "finish commit, Promoter.promote, Redis, pick-up / connect, claim, journal read",
        )
        report.row(
            "d",
            f"  runs of a key overlapping, {name}",
            str(overlaps),
            "a body started before the previous run of its key finished (must be 0)",
        )
    report.note(
        f"(d) {label}. A hand-off's latency: the body start of a key's next queued run (time.time() in the "
        "worker) minus the finished_at of the run before it (timezone.now() in the worker as it finishes, before "
        "its commit), two readings of one clock. It covers the finishing commit, Promoter.promote on commit, the "
        "Redis message, the worker picking it up, connecting (a worker thread's first run only, every run with "
        "KEEP_WORKER_CONNECTION off) and claiming the run."
    )
    latency, overlaps = measured.get(WORKER_DATABASES[0][0], ([], 0))
    p50, p99 = _report.percentile(latency, 50), _report.percentile(latency, 99)
    short = "" if len(latency) >= 200 else f"(only {len(latency)} hand-offs: --quick or --handoffs)"
    notes = [
        f"{WORKER_DATABASES[0][0]}, p99 {_report.ms(p99)}" if latency else "no hand-off measured",
        short,
        f"{overlaps} overlapping runs" if overlaps else "",
    ]
    report.target(
        "d",
        TARGET_D,
        "<= 50 ms",
        p50 if latency else None,
        bool(latency) and p50 <= 50_000 and overlaps == 0,
        _report.ms(p50) if latency else "-",
        "; ".join(part for part in notes if part),
    )


# -- (e) ------------------------------------------------------------------------
def section_e(pool: WorkerPool, opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    """Queued GROUP_ROUND_ROBIN admissions vs REJECT admissions; then the hand-offs that drain the queue."""
    procs = [p for p in opts.procs if p <= pool.size]
    runs, nkeys = opts.queued_runs, opts.queued_keys
    pool.call(range(max(procs)), {"cmd": "prepare", "kind": "grr", "limit": LIMIT}, timeout=600)
    statements = _statement_counts(report)
    grr: dict[int, list[float]] = {}
    reject: dict[int, list[float]] = {}
    ratios: dict[int, list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    drains: list[dict[str, Any]] = []
    for r in range(opts.grr_rounds):
        for n in procs if r % 2 == 0 else procs[::-1]:
            counts = [runs // n + (1 if i < runs % n else 0) for i in range(n)]
            rates: dict[str, float] = {}
            for kind in ("reject", "grr") if r % 2 == 0 else ("grr", "reject"):
                keys = [f"e{r}-{kind}-n{n}-k{j}" for j in range(nkeys)]
                if kind == "reject":
                    # Fresh keys, one start each first (creates their lock rows), as in (a).
                    pool.call(range(n), {"cmd": "warm", "keys": keys, "per_process": True}, timeout=600)
                else:
                    [filled] = pool.call([0], {"cmd": "fill", "keys": keys, "limit": LIMIT}, timeout=600)
                    if filled["statuses"] != {"pending": nkeys * LIMIT}:
                        raise RuntimeError(f"(e) filling {nkeys} keys gave {filled['statuses']}")
                message = {
                    "cmd": "admit",
                    "kind": kind,
                    "keys": keys,
                    "per_process": kind == "reject",
                    "counts": counts,
                    "size": n,
                }
                replies = pool.call(range(n), message, timeout=600)
                statuses: Counter[str] = Counter()
                for rep in replies:
                    statuses.update(rep["statuses"])
                expected = "queued" if kind == "grr" else "pending"
                if statuses != {expected: runs}:
                    raise RuntimeError(f"(e) {runs} {kind} starts were expected {expected}, got {dict(statuses)}")
                rates[kind] = runs / max(rep["elapsed"] for rep in replies)
                cpu.setdefault((kind, n), []).append(sum(rep["cpu"] for rep in replies) / runs)
                if kind == "grr" and n == procs[0]:
                    progress(f"(e) handing the {runs} queued runs their slots (completing runs, Promoter.promote)")
                    [drained] = pool.call([0], {"cmd": "drain", "keys": keys}, timeout=1200)
                    drains.append(drained)
            grr.setdefault(n, []).append(rates["grr"])
            reject.setdefault(n, []).append(rates["reject"])
            ratios.setdefault(n, []).append(rates["grr"] / rates["reject"])
            progress(
                f"(e) round {r + 1}/{opts.grr_rounds}, {n} proc: queued GRR {rates['grr']:,.0f} starts/s, "
                f"REJECT {rates['reject']:,.0f} starts/s"
            )
    _report_e(report, opts, procs, grr, reject, ratios, cpu, drains, statements)


def _report_e(
    report: Report,
    opts: Options,
    procs: list[int],
    grr: dict[int, list[float]],
    reject: dict[int, list[float]],
    ratios: dict[int, list[float]],
    cpu: dict[tuple[str, int], list[float]],
    drains: list[dict[str, Any]],
    statements: dict[str, int],
) -> None:
    runs, nkeys = opts.queued_runs, opts.queued_keys

    def detail(values: list[float], kind: str, n: int) -> str:
        rounds = f"median of {len(values)} rounds ({', '.join(f'{v:,.0f}' for v in values)})" if len(values) > 1 else ""
        client = f"client CPU {_report.median(cpu[(kind, n)]) * 1000:.2f} ms/start"
        return "; ".join(part for part in (rounds, client) if part)

    for n in procs:
        report.row(
            "e", f"queued GROUP_ROUND_ROBIN starts, {n} proc", _report.rate(_report.median(grr[n])), detail(grr[n], "grr", n)
        )
        report.row(
            "e",
            f"REJECT starts (durable_admit), {n} proc",
            _report.rate(_report.median(reject[n])),
            detail(reject[n], "reject", n),
        )
        values = ratios[n]
        report.row(
            "e",
            f"ratio queued GRR / REJECT, {n} proc",
            _report.ratio(_report.median(values)),
            f"rounds: {', '.join(f'{v:.2f}' for v in values)}" if len(values) > 1 else "",
        )
    handoff_rates = [d["handoffs"] / d["elapsed"] for d in drains]
    promote = sorted(us for d in drains for us in d["promote_us"])
    handoffs = sum(d["handoffs"] for d in drains)
    left = sum(d["queued_left"] for d in drains)
    if drains:
        report.row(
            "e",
            f"hand-offs (finish a run + the promote on commit), {procs[0]} proc",
            _report.rate(_report.median(handoff_rates)),
            f"{handoffs:,} hand-offs; finish + promote p50 {_report.ms(_report.percentile(promote, 50))}, "
            f"p99 {_report.ms(_report.percentile(promote, 99))}; queued runs left {left} (must be 0)",
        )
        calls = {name: sorted(us for d in drains for us in d["calls_us"][name]) for name in ("durable_end", "durable_promote")}
        report.row(
            "e",
            "  p50 durable_end / durable_promote, as the caller waits for each",
            " / ".join(_report.ms(_report.percentile(us, 50)) for us in calls.values()),
            f"{len(calls['durable_end']):,} / {len(calls['durable_promote']):,} calls; the rest of a finish is the client's",
        )
        rejected = _report.median(reject[procs[0]])
        report.row(
            "e",
            f"ratio hand-offs / REJECT starts, {procs[0]} proc",
            _report.ratio(_report.median(handoff_rates) / rejected),
            f"the load of the machine weighs on both; issue 10 measured {HANDOFF_BEFORE}/s against "
            f"{REJECT_BEFORE}/s ({HANDOFF_BEFORE / REJECT_BEFORE:.3f}x)",
        )
    report.note(
        f"(e) {runs:,} starts per configuration and round, on {nkeys} keys of limit {LIMIT}. Queued GRR: every key "
        "already at its limit, so each start is queued (on PostgreSQL durable_admit_queued, then durable_promote on "
        "commit in case a slot freed meanwhile); REJECT: the no-op workflow of (a) on fresh keys of limit "
        f"{starters.RATE_LIMIT} (durable_admit, one round trip). Both with a no-op dispatch. Hand-offs: each run in "
        "flight is claimed (untimed), then finished as a worker finishes it (Executor.finish: durable_end, then "
        "Executor.released's durable_promote on commit, which reads the run's keys itself), until the queue is "
        "empty; the rate is hand-offs over the time those finishes took."
    )
    ratio = _report.median(ratios[procs[0]])
    report.target(
        "e",
        f"queued GRR / REJECT start rate, {procs[0]} proc",
        ">= 0.5x",
        ratio,
        ratio >= 0.5,
        _report.ratio(ratio),
        f"SQL statements (Django's execute calls) of a queued start {statements['queued']}, of a REJECT start "
        f"{statements['reject']}",
    )
    if drains:
        rate = _report.median(handoff_rates)
        report.target(
            "e",
            f"hand-offs per second, {procs[0]} proc",
            f">= {HANDOFF_TARGET:,.0f}/s",
            rate,
            rate >= HANDOFF_TARGET and left == 0,
            _report.rate(rate),
            f"5x the {HANDOFF_BEFORE}/s issue 10 measured" + (f"; {left} queued runs left" if left else ""),
        )
        # The same, as a ratio to the REJECT starts of this run: the load of the machine weighs on both.
        relative = rate / _report.median(reject[procs[0]])
        goal = 5 * HANDOFF_BEFORE / REJECT_BEFORE
        report.target(
            "e",
            f"hand-offs / REJECT starts, {procs[0]} proc",
            f">= {goal:.2f}x",
            relative,
            relative >= goal and left == 0,
            _report.ratio(relative),
            f"5x the {HANDOFF_BEFORE / REJECT_BEFORE:.3f}x of issue 10 ({HANDOFF_BEFORE}/s against {REJECT_BEFORE}/s)",
        )
    for kind, what in (("queued", "queued GRR start"), ("handoff", "hand-off (finish + promote)")):
        count = statements[kind]
        report.target("e", f"SQL statements of a {what}", "<= 3", count, count <= 3, str(count))


#: Hand-offs per second issue 10 measured before durable_promote, and the target: 5x that.
HANDOFF_BEFORE = 44
#: REJECT starts per second measured in the same run as HANDOFF_BEFORE.
REJECT_BEFORE = 925
HANDOFF_TARGET = 5 * HANDOFF_BEFORE


def _statement_counts(report: Report) -> dict[str, int]:
    """SQL statements of a REJECT start, of a queued GRR start, and of one hand-off (in this process)."""
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from durable.status import RunStatus

    # The capture reads a log of at most 9,000 queries: (d) may have filled it.
    reset_queries()
    starter = starters.DurableStarter()
    starter.set_grr_limit(LIMIT)
    engine = starter.engine
    starter.start("e-probe-reject")
    with CaptureQueriesContext(connection) as rejected:
        starter.start("e-probe-reject")
    first = engine.start(starters.GRR_WORKFLOW, {"key": "e-probe-grr"})
    with CaptureQueriesContext(connection) as queued:
        queued_run = engine.start(starters.GRR_WORKFLOW, {"key": "e-probe-grr"})
    if queued_run.status != RunStatus.QUEUED:
        raise RuntimeError(f"(e) the queued start counted was {queued_run.status}")
    # The hand-off as a worker makes it: the finish of the run in flight, then on
    # commit (at once: autocommit) Executor.released's promote.
    claimed = engine.store.claim_journal(first.run_id, lease="bench", worker="bench", stale_before=timezone.now())
    assert claimed is not None, first.run_id
    with CaptureQueriesContext(connection) as handed:
        engine.executor.finish(claimed[0], "bench", RunStatus.COMPLETED)
    status = engine.get_run(queued_run.run_id).status
    if status != RunStatus.PENDING:
        raise RuntimeError(f"(e) the hand-off counted left the queued run {status}")
    one_step = engine.start(starters.ONE_STEP_WORKFLOW, {"key": "e-probe-one-step"})
    with CaptureQueriesContext(connection) as executed:
        engine.execute(one_step.run_id)
    status = engine.get_run(one_step.run_id).status
    if status != RunStatus.COMPLETED:
        raise RuntimeError(f"(e) the one-step run executed to count its statements ended {status}")
    report.row(
        "e",
        "SQL statements: REJECT start / queued start / hand-off / one-step run executed",
        f"{len(rejected)} / {len(queued)} / {len(handed)} / {len(executed)}",
        "BEGIN..COMMIT included; queued start: durable_admit_queued + the promote on commit, one call (a statement "
        "list, '...; COMMIT; ...') on Django's default client-side binding (targets <= 3); "
        "hand-off: a running run's finish + Executor.released's promote on commit (target <= 3); one-step run: "
        "Engine.execute of a pending run with a REJECT quota key (claim + journal read, step write, finish; no promote "
        "follows the finish, since no run of the key is queued)",
    )
    return {"reject": len(rejected), "queued": len(queued), "handoff": len(handed), "execute": len(executed)}
