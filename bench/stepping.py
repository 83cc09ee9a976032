"""Section (i): step-level quota hand-off latency with a real Celery worker,
against the run hand-off of section (d) measured the same way in the same worker.

Step chain: ``handoffs`` runs of ``bench.step_handoff`` on one key (a step quota
of limit 1). A holder run, executed in this process, takes the key's slot and
keeps it while every other run is executed here up to its limited step, where
it parks (in arrival order). The worker is started, the holder's step ends, and
from then on each step's release hands the slot to the next waiting step, whose
run the worker executes. A hand-off is timed from one step's body end to the
next step's body start (both ``time.time()`` in the worker).

Run chain, for comparison: ``handoffs`` runs of section (d)'s ``GROUP_ROUND_ROBIN``
workflow on one key, in the same worker, timed as (d) times them.

Then, in this process, what a step-level quota adds to a step whose key has room:
one-step runs executed with and without one, interleaved (``_step_cost``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg

from bench import queueing, step_handoff
from bench import report as _report
from bench.broker import broker_app, delete_queue, purge, reach
from bench.celery_worker import CeleryWorker
from bench.pool import WorkerError
from bench.report import Report
from bench.scratch import Scratch
from bench.sections import Options, Progress

TARGET_I = "step hand-off p50 / run hand-off p50 (same worker)"
HOLDER = "bench.step_holder"


def section_i(opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    n = opts.handoffs
    queue = f"durable-bench-{os.getpid()}-i"
    app = broker_app(opts.broker)
    reason = reach(app)
    if reason:
        app.close()
        progress(f"(i) left out: {reason}")
        report.row("i", "step hand-off latency", "-", f"not run: {reason}")
        report.target("i", TARGET_I, "(informational)", None, None, "-", reason, info=True)
        return
    conninfo = scratch.conninfo(scratch.main)
    name, query, _ = queueing.WORKER_DATABASES[0]
    worker = CeleryWorker(
        broker=opts.broker,
        database_url=scratch.url(scratch.main) + query,
        queue=queue,
        pool="threads",
        concurrency=1,
        include="bench.handoff,bench.step_handoff",
    )
    try:
        purge(app, queue)
        progress(f"(i) queueing {n} runs of (d)'s workflow on one key, and parking {n} steps on one step key")
        statuses = queueing._enqueue(app, queue, n, ["i-run-k0"])
        if statuses != {"pending": 1, "queued": n - 1}:
            raise RuntimeError(f"(i) expected 1 pending and {n - 1} queued runs, got {statuses}")
        release = threading.Event()
        holder = _park_steps(app, queue, n, "i-step-k0", release)
        progress(f"(i) starting a Celery worker ({worker.describe()}); waiting for the runs")
        with worker:
            queueing._wait_finished(conninfo, "i-run-", n, worker, progress, section="i")
            release.set()  # the holder's step ends: its release hands the slot to the first waiting step
            holder.join(timeout=60)
            queueing._wait_finished(conninfo, "i-step-", n, worker, progress, workflow=step_handoff.WORKFLOW, section="i")
    finally:
        try:
            delete_queue(app, queue)
        finally:
            app.close()
    runs = _run_latencies(conninfo)
    steps, overlaps = _step_latencies(conninfo)
    _report_i(report, runs, steps, overlaps, n, f"{name}; {worker.describe()}")
    progress("(i) a step with and without a step quota, executed in this process")
    _step_cost(report)


def _park_steps(app: Any, queue: str, n: int, key: str, release: threading.Event) -> threading.Thread:
    """Start a holder run and ``n`` runs on step key ``key``; execute the holder in a
    thread until its step holds the slot (it keeps it until ``release``), then
    execute the others here up to their step, where they park. Sends nothing but
    the wake-up of the first waiter, when the holder's step ends."""
    from django.db import connection

    from durable import Concurrency, DjangoStore, Engine, RunStatus
    from durable.runtime.registry import Registry

    registry = Registry()
    registry.register(step_handoff.WORKFLOW, step_handoff.VERSION, step_handoff.body)
    holding = threading.Event()

    def hold() -> str:
        holding.set()
        release.wait(timeout=600)
        return "held"

    registry.register(HOLDER, "1", lambda ctx, input: ctx.step("hold", hold, concurrency=Concurrency(key=input["key"], limit=1)))
    quiet = Engine(store=DjangoStore(), dispatch=lambda engine, run: None, registry=registry)
    sending = Engine(store=DjangoStore(), dispatch=queueing._Send(app, queue), registry=registry)
    holder_id = quiet.start(HOLDER, {"key": key}).run_id
    waiters = [quiet.start(step_handoff.WORKFLOW, {"key": key}, run_id=f"{key}-{i:05d}").run_id for i in range(n)]

    def execute_holder() -> None:
        try:
            sending.execute(holder_id)
        finally:
            connection.close()

    thread = threading.Thread(target=execute_holder, name="bench-step-holder", daemon=True)
    thread.start()
    if not holding.wait(timeout=60):
        raise WorkerError("(i) the holder's step did not take the key's slot")
    for run_id in waiters:
        quiet.execute(run_id)
        run = quiet.get_run(run_id).record
        if run.status != RunStatus.SUSPENDED:
            raise RuntimeError(f"(i) run {run_id} did not park for the step slot: {run.status}")
    return thread


def _run_latencies(conninfo: str) -> list[float]:
    """(d)'s measure: a run's body start minus the finished_at of the run before it on its key (us)."""
    latency = []
    for runs in queueing._chains(conninfo, "i-run-").values():
        latency += [(body - finished) * 1e6 for (_, _, finished), (_, body, _) in zip(runs, runs[1:], strict=False)]
    return sorted(latency)


_STEPS = """
SELECT (s.output ->> 'started')::float8, (s.output ->> 'ended')::float8
  FROM durable_steprecord s JOIN durable_workflowrun r ON r.id = s.run_id
 WHERE r.workflow = %s AND s.name = 'call' AND s.outcome = 'completed'
"""


def _step_latencies(conninfo: str) -> tuple[list[float], int]:
    """Each step's body start minus the body end of the step before it (us), and how
    many started before the one before them ended (must be 0: limit 1)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        bodies = sorted(conn.execute(_STEPS, (step_handoff.WORKFLOW,)).fetchall())
    gaps = [(started - ended) * 1e6 for (_, ended), (started, _) in zip(bodies, bodies[1:], strict=False)]
    return sorted(gaps), sum(1 for gap in gaps if gap < 0)


#: Runs of each kind executed by ``_step_cost`` (after 20 of each to warm up).
STEP_COST_RUNS = 300
#: The step-level quota of ``_step_cost``: a limit no run reaches (the key always has room).
STEP_COST_LIMIT = 1_000_000


def _step_cost(report: Report) -> None:
    """What a step-level quota adds to a step when its key has room: one-step runs
    executed in this process (``Engine.execute``, Django's connection), with the
    step under a quota and without, interleaved; p50 and SQL statements of each."""
    import time

    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    from durable import Concurrency, DjangoStore, Engine
    from durable.runtime.registry import Registry

    reset_queries()
    engine = Engine(store=DjangoStore(), dispatch=lambda engine, run: None, registry=Registry())
    limit = Concurrency(key="i-cost", limit=STEP_COST_LIMIT)
    engine.register("bench.step_plain", "1", lambda ctx, input: ctx.step("s", int))
    engine.register("bench.step_limited", "1", lambda ctx, input: ctx.step("s", int, concurrency=limit))
    kinds = ("bench.step_plain", "bench.step_limited")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    counted: dict[str, int] = {}
    for i in range(20 + STEP_COST_RUNS):
        for kind in kinds if i % 2 == 0 else reversed(kinds):
            run_id = engine.start(kind, {}).run_id
            t0 = time.perf_counter()
            with CaptureQueriesContext(connection) as executed:
                engine.execute(run_id)
            if i >= 20:
                times[kind].append((time.perf_counter() - t0) * 1e6)
            counted[kind] = len(executed)
    plain, limited = (_report.percentile(sorted(times[kind]), 50) for kind in kinds)
    report.row(
        "i",
        "one-step run executed, p50: plain / step under a quota with room",
        f"{_report.ms(plain)} / {_report.ms(limited)}",
        f"{counted[kinds[0]]} / {counted[kinds[1]]} SQL statements; {STEP_COST_RUNS} runs each, interleaved, "
        "Engine.execute in the benchmark process; the quota takes the slot and gives it back",
    )


def _report_i(report: Report, runs: list[float], steps: list[float], overlaps: int, n: int, label: str) -> None:
    def p(values: list[float], q: float) -> str:
        return _report.ms(_report.percentile(values, q)) if values else "-"

    report.row(
        "i",
        "step hand-off latency p50 / p99",
        f"{p(steps, 50)} / {p(steps, 99)}",
        f"{len(steps)} hand-offs between {n} steps of one step key, limit 1",
    )
    report.row(
        "i",
        "run hand-off latency p50 / p99, as (d)",
        f"{p(runs, 50)} / {p(runs, 99)}",
        f"{len(runs)} hand-offs between {n} GROUP_ROUND_ROBIN runs of one key, limit 1, same worker",
    )
    report.row(
        "i", "  steps of the key overlapping", str(overlaps), "a step body started before the previous one ended (must be 0)"
    )
    ratio = _report.percentile(steps, 50) / _report.percentile(runs, 50) if steps and runs else None
    report.note(
        f"(i) {label}. A step hand-off: the previous step's journal write (which frees its slot), its release "
        "handing the slot to the oldest waiting step, the wake-up of that step's run (suspended -> pending) and "
        "its Redis message, the worker claiming the run, replaying its journal up to the step and taking the "
        "slot up; timed from the previous step's body end to the next step's body start. With one worker thread, "
        "the previous run's finish (its last round trip) also comes before the next claim. The run hand-off is "
        "section (d)'s, measured in the same worker right before."
    )
    report.target(
        "i",
        TARGET_I,
        "(informational)",
        ratio,
        None,
        _report.ratio(ratio) if ratio is not None else "-",
        f"p50 {p(steps, 50)} against {p(runs, 50)}" + (f"; {overlaps} overlapping steps" if overlaps else ""),
        info=True,
    )
