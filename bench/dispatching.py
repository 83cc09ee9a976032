"""Section (f): from ``Wf.dispatch`` to the first step's body, with a warm Celery worker on Redis.

Against a baseline measured in the same run, sample by sample interleaved: a
bare Celery task that makes one committed database write, from ``apply_async``
to its body; and a third kind, the floor of any start that commits its run
before its message leaves (as durable's outbox does): the same bare task sent
right after a committed INSERT on the sender's connection. All are sent by
benchmark process 0 (its Celery app on the
``--broker``, durable's ``TASK_QUEUE`` set to the pool's queue) and run by one
``celery -A testproject worker`` consuming that queue, once per pool (threads,
prefork) and database setting (Django's default settings, Django's pool), then
extra rows without a target: threads with ``KEEP_WORKER_CONNECTION`` off; threads with
the pool, every message through the publisher's thread (direct writes off); and
threads with the pool while the sender keeps computing after each call (as a view
renders its response after starting a run), with and without direct writes. Rows
without a worker then show when a dispatch's message reaches the queue, as a
listener in another process sees it, with the sender waiting or computing after
each call (``HOP_ROWS``).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import psycopg

from bench import broker
from bench import report as _report
from bench.celery_worker import CeleryWorker
from bench.firststep import CREATE_PROBE_TABLE
from bench.pool import WorkerError, WorkerPool
from bench.queueing import DJANGO_CONNECTION, WITH_OPTION, WORKER_DATABASES, WORKER_ENV
from bench.report import Report
from bench.scratch import Scratch
from bench.sections import Options, Progress

POOLS = ("threads", "prefork")
#: Discarded samples of each kind at the start of each worker (the first also waits for the worker to start).
WARM = 3
#: Seconds a sample may take before the section gives up.
TIMEOUT = 30.0
TARGET = 1.2
#: The extra configuration whose sender computes (pure Python, holding the GIL) for this
#: many seconds after each call, the dispatch's and the bare task's alike.
BUSY_SECONDS = 0.002
BUSY_SUFFIX = f", the sender computing {BUSY_SECONDS * 1e3:g} ms after each call"
#: The publisher hop rows: seconds the sender computes after each call (0: it waits), and whether
#: the caller writes the message itself (the default) or hands it to the publisher's thread.
HOP_ROWS = ((0.0, True), (0.002, True), (0.010, True), (0.030, True), (0.0, False), (0.002, False))
#: The label of the (f) rows whose messages all go through the publisher's thread.
THREADED_SUFFIX = ", each message through the publisher's thread (no direct writes)"


def section_f(pool: WorkerPool, opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    app = broker.broker_app(opts.broker)
    reason = broker.reach(app)
    if reason:
        app.close()
        progress(f"(f) left out: {reason}")
        report.row("f", "dispatch to first step", "-", f"not run: {reason}")
        report.target("f", "dispatch -> first step p50 / bare task p50", f"<= {TARGET:.2f}x", None, None, "-", reason)
        return
    with psycopg.connect(scratch.conninfo(scratch.main), autocommit=True) as conn:
        conn.execute(CREATE_PROBE_TABLE)
    #: Per configuration: its label, whether it is an extra one (a row, no target), the latencies
    #: (dispatch, bare task, outbox task).
    measured: list[tuple[str, bool, list[float], list[float], list[float]]] = []
    #: Per configuration, how long the sender's call took (dispatch, apply_async, INSERT then apply_async).
    calls: list[tuple[list[float], list[float], list[float]]] = []
    #: Per configuration, how long after the dispatch call returned the publisher had the broker's reply to its
    #: batch (the dispatches whose message went through its thread), and how many the caller wrote itself.
    hops: list[tuple[list[float], int]] = []
    # (pool, worker database setting, its query string, seconds the sender computes after each call, direct writes)
    configurations = [(pool_kind, name, query, 0.0, True) for pool_kind in POOLS for name, query, _ in WORKER_DATABASES]
    pooled = WORKER_DATABASES[1]
    configurations.append((POOLS[0], pooled[0], pooled[1], 0.0, False))
    configurations.append((POOLS[0], DJANGO_CONNECTION[0], DJANGO_CONNECTION[1], 0.0, True))
    configurations.append((POOLS[0], pooled[0], pooled[1], BUSY_SECONDS, True))
    configurations.append((POOLS[0], pooled[0], pooled[1], BUSY_SECONDS, False))
    try:
        progress(f"(f) the publisher's hop: {opts.first_steps} dispatches per row to a queue a listener reads")
        arrivals = _publish_hops(pool, opts, app)
        for pool_kind, name, query, busy, direct in configurations:
            label = f"{pool_kind}, {name}{BUSY_SUFFIX if busy else ''}{'' if direct else THREADED_SUFFIX}"
            extra = bool(busy) or name == DJANGO_CONNECTION[0] or not direct
            broker.purge(app, opts.pool_queue)  # what (a) left, if anything
            worker = CeleryWorker(
                broker=opts.broker,
                database_url=scratch.url(scratch.main) + query,
                queue=opts.pool_queue,
                pool=pool_kind,
                concurrency=1,
                include="bench.firststep",
                env=WORKER_ENV.get(name),
            )
            progress(f"(f) {label}: {opts.first_steps} dispatches and bare tasks, interleaved ({worker.describe()})")
            message = {
                "cmd": "firststep",
                "samples": opts.first_steps,
                "warm": WARM,
                "timeout": TIMEOUT,
                "busy": busy,
                "direct": direct,
            }
            with worker:
                [reply] = pool.call_lenient([0], message, timeout=TIMEOUT * (2 * (opts.first_steps + WARM) + 4))
                if "error" in reply:
                    worker.check()
                    raise WorkerError(f"(f) {label} failed:\n{reply['error']}\nthe worker's log:\n{worker.log_tail()}")
            latency, call = reply["latency_us"], reply["call_us"]
            dispatch, bare, outbox = (sorted(latency[kind]) for kind in ("dispatch", "baseline", "outbox"))
            measured.append((label, extra, dispatch, bare, outbox))
            calls.append((sorted(call["dispatch"]), sorted(call["baseline"]), sorted(call["outbox"])))
            hops.append((sorted(reply["hop_us"]), int(reply["direct"])))
    finally:
        try:
            broker.purge(app, opts.pool_queue)
        finally:
            app.close()
    _report_f(report, opts, measured, calls, hops)
    for (busy, direct), hop in arrivals.items():
        sender = f"the sender computing {busy * 1e3:g} ms after each call" if busy else "the sender waiting after each call"
        report.row(
            "f",
            f"dispatch's message in the queue after the call returned p50 / p90, {sender}{'' if direct else THREADED_SUFFIX}",
            f"{_report.ms(_report.percentile(hop, 50))} / {_report.ms(_report.percentile(hop, 90))}",
            f"{len(hop)} dispatches, one at a time; a listener's BLPOP stamps each message's arrival",
        )


def _publish_hops(pool: WorkerPool, opts: Options, app: Any) -> dict[tuple[float, bool], list[float]]:
    """Per ``HOP_ROWS``: how long after each dispatch call returned its message was in a Redis
    queue no worker consumes (microseconds, sorted), stamped by a thread of this process in
    ``BLPOP`` on it: benchmark process 0 sends, so this process's GIL is not the sender's."""
    queue = f"{opts.pool_queue}-hop"
    arrived: dict[str, float] = {}
    failed: list[BaseException] = []
    stop = threading.Event()

    def listen() -> None:
        try:
            with app.connection_for_write() as conn:
                client = conn.default_channel.client
                while not stop.is_set():
                    got = client.blpop([queue], timeout=1)
                    if got is not None:
                        at = time.time()
                        arrived[json.loads(got[1])["headers"]["id"]] = at
        except BaseException as exc:  # told by the section, not lost in the thread
            failed.append(exc)

    listener = threading.Thread(target=listen, name="durable-bench-hop-listener", daemon=True)
    listener.start()
    try:
        message = {"cmd": "publishhop", "queue": queue, "samples": opts.first_steps, "warm": WARM, "rows": HOP_ROWS}
        per_sample = 0.05 + max(busy for busy, _ in HOP_ROWS)
        [reply] = pool.call([0], message, timeout=TIMEOUT + per_sample * len(HOP_ROWS) * (opts.first_steps + WARM))
        sent = {row: reply["returned"][repr(row)] for row in HOP_ROWS}
        deadline = time.monotonic() + TIMEOUT
        while any(task not in arrived for rows in sent.values() for task, _ in rows):
            if failed:
                raise WorkerError(f"(f) the listener on {queue} failed: {failed[0]!r}") from failed[0]
            if time.monotonic() > deadline:
                raise WorkerError(f"(f) messages sent to {queue} did not reach the listener within {TIMEOUT:g} s")
            time.sleep(0.01)
    finally:
        stop.set()
        listener.join(5)
        broker.delete_queue(app, queue)
    return {busy: sorted((arrived[task] - at) * 1e6 for task, at in rows) for busy, rows in sent.items()}


def _report_f(
    report: Report,
    opts: Options,
    measured: list[tuple[str, bool, list[float], list[float], list[float]]],
    calls: list[tuple[list[float], list[float], list[float]]],
    hops: list[tuple[list[float], int]],
) -> None:
    def p(values: list[float], q: float) -> str:
        return _report.ms(_report.percentile(values, q)) if values else "-"

    for (label, _, dispatch, baseline, outbox), (dispatch_call, apply_call, outbox_call), (hop, direct) in zip(
        measured, calls, hops, strict=True
    ):
        through = (
            f"; through the publisher's thread: it read the broker's reply to its batch p50 {p(hop, 50)} after the call returned"
            if hop
            else ""
        )
        report.row(
            "f",
            f"dispatch -> first step p50 / p99, {label}",
            f"{p(dispatch, 50)} / {p(dispatch, 99)}",
            f"the dispatch call itself p50 {p(dispatch_call, 50)}; message written by the caller for {direct} of "
            f"{len(dispatch)}{through}",
        )
        report.row(
            "f",
            f"bare task -> its write committed p50 / p99, {label}",
            f"{p(baseline, 50)} / {p(baseline, 99)}",
            f"the apply_async call itself p50 {p(apply_call, 50)}",
        )
        report.row(
            "f",
            f"outbox task -> its write committed p50 / p99, {label}",
            f"{p(outbox, 50)} / {p(outbox, 99)}",
            f"the bare task sent after a committed INSERT on the sender's connection; that call p50 {p(outbox_call, 50)}",
        )
    for label, extra, dispatch, baseline, outbox in measured:
        ratio = _report.percentile(dispatch, 50) / _report.percentile(baseline, 50)
        short = "" if len(dispatch) >= 100 else f"(only {len(dispatch)} samples: --quick or --first-steps)"
        if extra:  # a row, no target
            report.row("f", f"ratio dispatch -> first step / bare task p50, {label}", _report.ratio(ratio), "option")
            continue
        floor = _report.percentile(outbox, 50) / _report.percentile(baseline, 50)
        over = _report.percentile(dispatch, 50) / _report.percentile(outbox, 50)
        report.row("f", f"ratio outbox task / bare task p50, {label}", _report.ratio(floor), "extra: commit, then send")
        report.row("f", f"ratio dispatch -> first step / outbox task p50, {label}", _report.ratio(over), "extra")
        report.target(
            "f",
            f"dispatch -> first step p50 / bare task p50, {label}",
            f"<= {TARGET:.2f}x",
            ratio,
            ratio <= TARGET,
            _report.ratio(ratio),
            short,
        )
    databases = "; ".join(f"{name}: {what}" for name, _, what in WITH_OPTION)
    report.note(
        f"(f) {opts.first_steps} samples of each kind per configuration after {WARM} discarded, one message at a "
        "time, the two kinds alternating: FirstStep.dispatch (bench/firststep.py: the start transaction, the Celery "
        "message on commit) to the time.time() its first step's body reads in the worker (claim, journal read, then "
        "the step); the baseline, a bare Celery task that INSERTs one row (one committed write, autocommit: with "
        "Django's default settings it connects first) and reads time.time() once that write is committed, from "
        "apply_async; a second statement then stores the reading for the benchmark, after the measured interval "
        "(durable's reading is stored by its journal write and finish, after it too). Both are read from the "
        "worker's clock against the sender's time.time() on the same machine. The outbox task (extra rows): the "
        "bare task, sent right after one INSERT into a table of one index committed on the sender's connection "
        "(autocommit), the least a start does that commits its run before the message leaves; its ratio to the "
        "bare task is the floor of that design, and dispatch's ratio to it what durable adds over that floor. "
        "One worker per configuration, "
        f"--concurrency=1, on the --broker. {databases}."
    )
    report.note(
        "(f) where durable's time goes: the dispatch call is the admission transaction (one round trip to "
        "PostgreSQL, which the bare task does not make), then on commit the message: once the publisher has a "
        "verified template for the queue, the caller's thread writes it to Redis itself before the call returns "
        "(the count in the note of each dispatch row), without waiting for the reply (the publisher's thread reads "
        "it); with direct writes off (the option rows) the message is handed to the publisher's thread, which "
        "sends it after its wake-up and its turn at the GIL (the hop in the note of those rows is when it read the "
        "broker's reply, an upper bound; the rows 'dispatch's message in the queue' stamp the arrival from another "
        "process). apply_async sends on the caller's thread and waits for Redis's reply: its message left inside "
        "its call, a part of the call the worker already works in. In the worker "
        "the claim is one round trip (one committed write, as the baseline's INSERT), and the first step runs "
        "without another read (the claim proved the lease). Celery's Django fix-up (celery.fixups.django, Celery "
        "5.7) closes Django's connections before and after every task, and in a prefork child also Django's "
        "connection pool: the bare task opens a new PostgreSQL backend per task in every configuration but "
        "threads with the pool. durable's claim, journal write and finish run on the connection the worker "
        "thread keeps (KEEP_WORKER_CONNECTION); with it off (the option row), a new backend costs durable's claim "
        "more than the bare INSERT (the catalog entries of the run, tag and journal tables and their indexes, and "
        "PL/pgSQL)."
    )
    report.note(
        f"(f) {POOLS[0]}, {WORKER_DATABASES[1][0]}{BUSY_SUFFIX} (options): the sender computes "
        f"{BUSY_SECONDS * 1e3:g} ms in Python right after each "
        "call, dispatch and apply_async alike, as a view renders its response after starting a run; both latencies "
        "include it. A message the caller writes itself is in Redis before the computing starts. Through the "
        "publisher's thread (direct writes off), the thread needs the GIL to build and send the message: it gets "
        "it when the sender's thread next waits (I/O, a sleep) or after Python's switch interval "
        "(sys.getswitchinterval(), 5 ms), so the message leaves after the computing, not during it."
    )
