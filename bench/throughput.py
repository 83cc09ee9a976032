"""Section (g): one-step runs completed per second by one Celery worker process,
against procrastinate's worker on the same scratch database and the same no-op job.

Each round pre-loads ``--runs`` of each kind while nothing consumes them: durable
runs of ``bench.noop`` started by ``Engine.start`` (their Celery messages sent to
a queue of the round, in Redis), procrastinate jobs deferred onto a queue of the
round. Then, one kind at a time, a worker is started on that queue and the
benchmark waits until every run is completed and stops it:

- durable: ``celery -A testproject worker --pool=threads --concurrency=4``, with
  Django's default settings (durable's statements on the connections the worker
  keeps), then with Django's connection pool, then (a row without a target) with
  the default settings and ``KEEP_WORKER_CONNECTION`` off;
- procrastinate: ``procrastinate worker --concurrency=4`` (one process).

What is timed is the same for both: from the first completion to the last, read
from the database (durable: the runs' ``finished_at``; procrastinate: the time of
its jobs' ``succeeded`` events), so a worker's start-up is not counted;
rate = (runs - 1) / that span. Kinds alternate in order from round to round.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench import broker
from bench import report as _report
from bench.celery_worker import CeleryWorker, WorkerProcess
from bench.pool import WorkerError
from bench.queueing import DJANGO_CONNECTION, WITH_OPTION, WORKER_ENV
from bench.report import Report
from bench.scratch import Scratch
from bench.sections import Options, Progress

TARGET = 1.0
CONCURRENCY = 4
#: Seconds without a new completion before the section gives up.
STALL = 60.0

_DURABLE_DONE = """
SELECT count(*), extract(epoch FROM min(finished_at))::float8, extract(epoch FROM max(finished_at))::float8
  FROM durable_workflowrun WHERE workflow = %s AND status = 'completed' AND input ->> 'round' = %s
"""
_DURABLE_BAD = "SELECT count(*) FROM durable_workflowrun WHERE workflow = %s AND status IN ('failed', 'dead', 'cancelled')"
_PROCRASTINATE_DONE = """
SELECT count(*), extract(epoch FROM min(e.at))::float8, extract(epoch FROM max(e.at))::float8
  FROM procrastinate_events e JOIN procrastinate_jobs j ON j.id = e.job_id
 WHERE j.queue_name = %s AND e.type = 'succeeded'
"""
_PROCRASTINATE_BAD = "SELECT count(*) FROM procrastinate_jobs WHERE queue_name = %s AND status IN ('failed', 'aborted')"


def section_g(opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    app = broker.broker_app(opts.broker)
    reason = broker.reach(app) or opts.unavailable.get("procrastinate", "")
    if reason:
        app.close()
        progress(f"(g) left out: {reason}")
        report.row("g", "one-step runs per second", "-", f"not run: {reason}")
        report.target("g", "durable worker / procrastinate worker, runs/s", f">= {TARGET:.2f}x", None, None, "-", reason)
        return
    configurations = {f"durable, {name}": (name, query) for name, query, _ in WITH_OPTION}
    kinds = [*configurations, "procrastinate"]
    rates: dict[str, dict[int, float]] = {kind: {} for kind in kinds}
    conninfo = scratch.conninfo(scratch.main)
    queues: list[str] = []
    try:
        for r in range(opts.g_rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                queue = f"durable-bench-{os.getpid()}-g{r}-{len(queues)}"
                queues.append(queue)
                progress(f"(g) round {r + 1}/{opts.g_rounds}: {kind}, pre-loading {opts.g_runs} runs")
                if kind == "procrastinate":
                    rate = _procrastinate(opts, conninfo, queue)
                else:
                    name, query = configurations[kind]
                    rate = _durable(opts, app, scratch, conninfo, queue, query, WORKER_ENV.get(name))
                rates[kind][r] = rate
                progress(f"(g) round {r + 1}/{opts.g_rounds}: {kind}: {rate:,.0f} runs/s")
    finally:
        try:
            for queue in queues:
                broker.delete_queue(app, queue)
        finally:
            app.close()
    _report_g(report, opts, rates)


def _durable(
    opts: Options, app: Any, scratch: Scratch, conninfo: str, queue: str, query: str, env: dict[str, str] | None
) -> float:
    from bench import noop
    from bench.queueing import _Send
    from durable import DjangoStore, Engine
    from durable.runtime.registry import Registry

    engine = Engine(store=DjangoStore(), dispatch=_Send(app, queue), registry=Registry())
    engine.register(noop.WORKFLOW, noop.VERSION, noop.Noop._execute)
    for _ in range(opts.g_runs):
        engine.start(noop.WORKFLOW, {"round": queue})
    waiting = broker.queue_length(app, queue)
    if waiting != opts.g_runs:
        raise WorkerError(f"(g) {waiting} of {opts.g_runs} messages are in the queue {queue}")
    worker = CeleryWorker(
        broker=opts.broker,
        database_url=scratch.url(scratch.main) + query,
        queue=queue,
        pool="threads",
        concurrency=CONCURRENCY,
        include="bench.noop",
        env=env,
    )
    with worker:

        def done(conn: psycopg.Connection[Any]) -> tuple[int, float, float]:
            if conn.execute(_DURABLE_BAD, (noop.WORKFLOW,)).fetchone()[0]:
                raise WorkerError(f"(g) some runs did not complete; the worker's log:\n{worker.log_tail()}")
            count, first, last = conn.execute(_DURABLE_DONE, (noop.WORKFLOW, queue)).fetchone()
            return int(count), float(first or 0), float(last or 0)

        return _wait(conninfo, opts.g_runs, done, worker.check, worker.log_tail)


def _procrastinate(opts: Options, conninfo: str, queue: str) -> float:
    import procrastinate

    from bench import procrastinate_app

    deferrer = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=conninfo, min_size=1, max_size=1))
    task = deferrer.task(name=procrastinate_app.JOB_NAME, queue=queue)(procrastinate_app.noop)
    with deferrer.open():
        for _ in range(opts.g_runs):
            task.defer(round=queue)
    with _ProcrastinateWorker(conninfo, queue) as worker:

        def done(conn: psycopg.Connection[Any]) -> tuple[int, float, float]:
            if conn.execute(_PROCRASTINATE_BAD, (queue,)).fetchone()[0]:
                raise WorkerError(f"(g) some procrastinate jobs failed; its log:\n{worker.log_tail()}")
            count, first, last = conn.execute(_PROCRASTINATE_DONE, (queue,)).fetchone()
            return int(count), float(first or 0), float(last or 0)

        return _wait(conninfo, opts.g_runs, done, worker.check, worker.log_tail)


def _wait(
    conninfo: str,
    n: int,
    done: Callable[[psycopg.Connection[Any]], tuple[int, float, float]],
    check: Callable[[], None],
    log_tail: Callable[[], str],
) -> float:
    """Poll until ``n`` completions; the rate between the first and the last."""
    count, last_count, last_change = 0, -1, time.monotonic()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while True:
            check()
            count, first, last = done(conn)
            if count >= n:
                return (count - 1) / (last - first) if last > first else float("nan")
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            elif time.monotonic() - last_change > STALL:
                raise WorkerError(f"(g) no completion for {STALL:.0f} s ({count} of {n}); the log:\n{log_tail()}")
            time.sleep(0.05)


class _ProcrastinateWorker(WorkerProcess):
    """``procrastinate worker`` in a process of its own, on one queue; stopped like the Celery worker."""

    name = "procrastinate worker"

    def __init__(self, conninfo: str, queue: str, stop_timeout: float = 20.0) -> None:
        super().__init__(stop_timeout=stop_timeout)
        self.conninfo, self.queue = conninfo, queue

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "procrastinate",
            "--app=bench.procrastinate_app.app",
            "--log-level=warning",
            "worker",
            f"--queues={self.queue}",
            f"--concurrency={CONCURRENCY}",
        ]

    def extra_env(self) -> dict[str, str]:
        return {"DURABLE_BENCH_CONNINFO": self.conninfo}


def _report_g(report: Report, opts: Options, rates: dict[str, dict[int, float]]) -> None:
    theirs = rates["procrastinate"]
    for kind, by_round in rates.items():
        values = list(by_round.values())
        detail = ", ".join(f"{v:,.0f}" for v in values)
        note = f"median of {len(values)} rounds ({detail})" if len(values) > 1 else f"{opts.g_runs} runs"
        report.row("g", f"one-step runs/s, {kind}", _report.rate(_report.median(values)), note)
    for name, _, _ in WITH_OPTION:
        kind = f"durable, {name}"
        pairs = [rates[kind][r] / theirs[r] for r in rates[kind] if theirs.get(r)]
        value = _report.median(pairs) if pairs else None
        short = "" if opts.g_runs >= 1000 else f"(only {opts.g_runs} runs per round: --quick or --g-runs)"
        rounds = f"rounds: {', '.join(f'{p:.2f}' for p in pairs)} " if len(pairs) > 1 else ""
        if name == DJANGO_CONNECTION[0]:  # the extra configuration: a row, no target
            shown = _report.ratio(value) if value is not None else "-"
            report.row("g", f"ratio durable worker / procrastinate worker, {name}", shown, f"option; {rounds}{short}")
            continue
        report.target(
            "g",
            f"durable worker / procrastinate worker, runs/s, {name}",
            f">= {TARGET:.2f}x",
            value,
            value is not None and value >= TARGET,
            _report.ratio(value) if value is not None else "-",
            rounds + short,
        )
    databases = "; ".join(f"{name}: {what}" for name, _, what in WITH_OPTION)
    report.note(
        f"(g) {opts.g_runs} runs per kind and round, pre-loaded while no worker runs, then one worker process "
        f"(concurrency {CONCURRENCY}) until all are completed: durable, a one-step workflow (bench/noop.py; "
        "Engine.start, its Celery message to Redis) executed by celery -A testproject worker --pool=threads; "
        "procrastinate, a job deferred with the same no-op function (bench/procrastinate_app.py) executed by "
        "procrastinate worker. Timed from the first completion to the last, read from the database (durable's "
        "finished_at, procrastinate's 'succeeded' events): rate = (runs - 1) / that span; a worker's start-up is "
        f"not counted. Ratios are medians of per-round ratios. {databases}."
    )
    report.note(
        "(g) per task: Celery's Django fix-up closes the worker's Django connections before and after every task; "
        "durable's statements run on the connections the worker's threads keep (KEEP_WORKER_CONNECTION), as "
        "procrastinate's worker keeps its own. With it off (the option row) each run opens a new PostgreSQL "
        "backend, whose first queries load the catalog entries of durable's tables and indexes and compile its "
        "PL/pgSQL functions."
    )
