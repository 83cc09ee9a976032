"""Sections (a) start rate, (b) hot key at its limit, (c) start latency with a big history."""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from bench import broker, history, starters
from bench import report as _report
from bench.pool import WorkerError, WorkerPool
from bench.report import Report
from bench.scratch import Scratch
from durable.status import DEFAULT_CONCURRENCY_STATUSES

Progress = Callable[[str], None]

KINDS = (
    "dispatch",
    "dispatch_threaded",
    "dispatch_unbatched",
    "dispatch_sync",
    "dispatch_kombu",
    "dispatch_prepared",
    "durable",
    "raw",
    "procrastinate",
    "dbos",
)
#: The kinds that send a Celery message per start (counted in the queue after each round).
DISPATCH_KINDS = ("dispatch", "dispatch_threaded", "dispatch_unbatched", "dispatch_sync", "dispatch_kombu", "dispatch_prepared")
LABELS = {
    "dispatch": "durable Wf.dispatch (Celery message to Redis)",
    "dispatch_threaded": "option: Wf.dispatch, each message through the publisher's thread (no direct writes)",
    "dispatch_unbatched": "option: Wf.dispatch through the publisher's thread, each batch at once (PUBLISH_BATCH_INTERVAL 0)",
    "dispatch_sync": "option: Wf.dispatch, message sent on the caller's thread (PUBLISH_IN_BACKGROUND off)",
    "dispatch_kombu": "option: Wf.dispatch, each message built by kombu (no templates)",
    "dispatch_prepared": "option: Wf.dispatch, prepared statements (OPTIONS server_side_binding, prepare_threshold 5)",
    "durable": "shortcut: Engine.start, no-op dispatch (runs never execute)",
    "raw": "raw psycopg transaction",
    "procrastinate": "procrastinate defer",
    "dbos": "DBOS enqueue",
}
_COUNT = history.COUNT


@dataclass
class Options:
    quick: bool
    only: tuple[str, ...]
    db_name: str
    # (a)
    seconds: float
    rounds: int
    procs: tuple[int, ...]
    keys: int
    # (b)
    starters: int
    hot_limit: int
    hot_seconds: float
    free_rate: float
    # (c)
    finished_runs: int
    latency_starts: int
    latency_keys: int = 100
    # (d)
    broker: str = "redis://127.0.0.1:6379/9"
    #: Where ``broker`` came from: "--broker", "CELERY_BROKER_URL" or "default".
    broker_source: str = "default"
    handoffs: int = 300
    handoff_keys: int = 1
    # (e)
    queued_runs: int = 1000
    queued_keys: int = 50
    grr_rounds: int = 3
    # (f)
    first_steps: int = 200
    # (g)
    g_runs: int = 2000
    g_rounds: int = 3
    #: The queue the benchmark processes' Celery messages go to (durable's TASK_QUEUE there):
    #: nothing consumes it in (a); the Celery worker of (f) does.
    pool_queue: str = "durable-bench-pool"
    #: Why procrastinate or DBOS is left out (kind -> reason), filled as the run goes.
    unavailable: dict[str, str] = field(default_factory=dict)


# -- (a) ------------------------------------------------------------------------
def section_a(pool: WorkerPool, opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    """Starts per second on distinct keys, at each process count, against the baselines."""
    _query_counts(report)
    app = broker.broker_app(opts.broker)
    reason = broker.reach(app)
    if reason:
        for kind in DISPATCH_KINDS:
            opts.unavailable[kind] = reason
    try:
        _measure_a(pool, opts, report, progress, app)
    finally:
        if not reason:
            broker.purge(app, opts.pool_queue)
        app.close()


def _measure_a(
    pool: WorkerPool,
    opts: Options,
    report: Report,
    progress: Progress,
    app: Any,
) -> None:
    configs = [(kind, n) for n in opts.procs for kind in KINDS if kind not in opts.unavailable]
    for kind, n in configs:
        if kind in opts.unavailable:
            continue
        progress(f"(a) preparing {LABELS[kind]} in {n} process(es)")
        replies = pool.call_lenient(range(n), {"cmd": "prepare", "kind": kind, "nkeys": opts.keys}, timeout=600)
        _drop_failed(kind, replies, opts, pool, required=kind in ("durable", "raw"))
    # rates[(kind, n)][round] = starts/s; cpu[(kind, n)] = client CPU seconds per start.
    rates: dict[tuple[str, int], dict[int, float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    # Per dispatch round: (messages sent, the queue's length in Redis after the round).
    queued: list[tuple[int, int]] = []
    for r in range(opts.rounds):
        # Reverse the order every other round, so drift in the machine's load
        # does not always favour the same configuration.
        for kind, n in configs if r % 2 == 0 else configs[::-1]:
            if kind in opts.unavailable:
                continue
            if kind in DISPATCH_KINDS:
                broker.purge(app, opts.pool_queue)  # the warm-up's messages, the previous round's
            message = {"cmd": "rate", "kind": kind, "seconds": opts.seconds, "nkeys": opts.keys, "size": n, "round": r}
            replies = pool.call_lenient(range(n), message, timeout=opts.seconds + 300)
            if _drop_failed(kind, replies, opts, pool, required=kind in ("durable", "raw")):
                continue
            if kind in DISPATCH_KINDS:
                # Nothing consumes the queue: every message sent must be in it (the
                # round ended once the publisher had published them all).
                sent = sum(rep["count"] + rep["warmed"] for rep in replies)  # the round's keys warmed first
                queued.append((sent, broker.queue_length(app, opts.pool_queue)))
                broker.purge(app, opts.pool_queue)
            total = sum(rep["count"] / rep["elapsed"] for rep in replies)
            refused = sum(rep["refused"] for rep in replies)
            if refused:
                report.note(f"(a) {LABELS[kind]} x{n}: {refused} starts were refused (quota full?)")
            rates.setdefault((kind, n), {})[r] = total
            cpu.setdefault((kind, n), []).append(sum(rep["cpu"] for rep in replies) / sum(rep["count"] for rep in replies))
            progress(f"(a) round {r + 1}/{opts.rounds}: {LABELS[kind]}, {n} proc: {total:,.0f} starts/s")

    for kind, n in configs:
        values = list(rates.get((kind, n), {}).values())
        if not values:
            continue
        detail = ", ".join(f"{v:,.0f}" for v in values)
        note = f"median of {len(values)} rounds ({detail})" if len(values) > 1 else f"{opts.seconds:g} s"
        note += f"; client CPU {_report.median(cpu[(kind, n)]) * 1000:.2f} ms/start"
        report.row("a", f"{LABELS[kind]}, {n} proc", _report.rate(_report.median(values)), note)
    for kind, reason in opts.unavailable.items():
        report.row("a", LABELS[kind], "-", f"not run: {reason}")

    def ratio(mine_kind: str, other: str, n: int) -> tuple[float | None, str]:
        """Median over the rounds of durable's rate / the other's, each pair measured back to back."""
        mine, theirs = rates.get((mine_kind, n), {}), rates.get((other, n), {})
        pairs = [mine[r] / theirs[r] for r in mine if theirs.get(r)]
        if not pairs:
            return None, "-"
        detail = f" (rounds: {', '.join(f'{x:.2f}' for x in pairs)})" if len(pairs) > 1 else ""
        return _report.median(pairs), detail

    for other in ("raw", "procrastinate", "dbos"):
        for n in opts.procs:
            value, detail = ratio("dispatch", other, n)
            if value is not None:
                report.row("a", f"ratio dispatch/{other}, {n} proc", _report.ratio(value), detail.strip(" ()"))
    for option, named in (
        ("dispatch_threaded", "through the publisher's thread"),
        ("dispatch_unbatched", "each batch at once"),
        ("dispatch_sync", "sent on the caller's thread"),
        ("dispatch_kombu", "each message built by kombu"),
        ("dispatch_prepared", "prepared statements"),
    ):
        for n in opts.procs:
            value, detail = ratio("dispatch", option, n)
            if value is not None:
                report.row("a", f"ratio dispatch/option {named}, {n} proc", _report.ratio(value), detail.strip(" ()"))
    for n in opts.procs:
        value, detail = ratio("durable", "raw", n)
        if value is not None:
            report.row("a", f"ratio shortcut (no-op dispatch)/raw, {n} proc", _report.ratio(value), detail.strip(" ()"))

    missing = opts.unavailable.get("dispatch", "")
    n_raw = 4 if 4 in opts.procs else max(opts.procs)
    value, _ = ratio("dispatch", "raw", n_raw)
    report.target(
        "a",
        f"dispatch/raw starts at {n_raw} processes",
        ">= 0.90x",
        value,
        value is not None and value >= 0.9,
        _report.ratio(value) if value is not None else "-",
        missing or ("" if n_raw == 4 else "(4 processes not measured: --procs)"),
    )
    value, _ = ratio("dispatch", "procrastinate", 1) if 1 in opts.procs else (None, "")
    report.target(
        "a",
        "dispatch/procrastinate defer at 1 process",
        ">= 1.00x",
        value,
        value is not None and value >= 1.0,
        _report.ratio(value) if value is not None else "-",
        missing or opts.unavailable.get("procrastinate", "" if 1 in opts.procs else "(1 process not measured: --procs)"),
    )
    if queued:
        rounds = ", ".join(f"{length:,} of {sent:,}" for sent, length in queued)
        lost = "" if all(sent == length for sent, length in queued) else " (MISMATCH: messages missing)"
        report.note(
            f"(a) dispatch and its options: messages in the Redis queue {opts.pool_queue} "
            f"after each round (nothing consumes it; purged after each round): {rounds}{lost}"
        )
    report.note(
        "(a) dispatch: FirstStep.dispatch (bench/firststep.py, a DurableWorkflow on durable's default engine): "
        "the admission transaction, then on commit the Celery message: once the publisher has a verified template "
        "for the queue (from the first two messages), the caller's thread renders it and writes its LPUSH on the "
        "publisher's direct connection to the --broker without waiting for the reply, which the publisher's thread "
        "reads (durable.tasks.direct); each round ends when the publisher "
        "has every message of the round confirmed (durable.tasks.publisher.flush, inside the timed window and the "
        "CPU time, which counts every thread of the process). DEBUG off in the benchmark processes. Option through "
        "the publisher's thread: the default dispatch with direct writes off (durable.tasks.publishing.DIRECT_WRITES): "
        "each message handed to the background publisher, which publishes it (one Redis pipeline per batch, "
        "batches at least PUBLISH_BATCH_INTERVAL, 5 ms by default, apart), as before direct writes. Option sent on "
        "the caller's thread: the same with PUBLISH_IN_BACKGROUND off (execute_run.apply_async after the commit, "
        "as before the publisher). Option each batch at once: through the publisher's thread with "
        "PUBLISH_BATCH_INTERVAL 0 (a batch as soon as the thread gets to it: one message per pipeline at these "
        "rates). Option each message built by kombu: the default dispatch with the publisher's templates put aside "
        "(durable.tasks.publishing.TEMPLATES off, so no direct writes either): Celery and kombu build every "
        "message in the publisher's thread, as before templates. "
        "Option prepared statements: the default dispatch on a Django connection with OPTIONS server_side_binding "
        "and prepare_threshold 5 (the call of durable_admit prepared, as the raw transaction's statements are). "
        "Shortcut: Engine.start with a no-op dispatch, the same transaction and no message "
        "(those runs never execute); raw: the same transaction in psycopg 3 (BEGIN; SELECT lock row FOR UPDATE; "
        "COUNT tags; INSERT run; INSERT tag; COMMIT; psycopg's defaults: each statement prepared from its sixth "
        "execution); procrastinate: task.defer() on a SyncPsycopgConnector app; "
        "DBOS: DBOSClient.enqueue() onto a queue (no executor running). Ratios are medians of per-round ratios, "
        "each pair measured back to back."
    )


def _query_counts(report: Report) -> None:
    """How many SQL statements one start sends (first start of a key, then steady state)."""
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    starter = starters.DurableStarter()
    counts = []
    for _ in range(2):
        # Django keeps at most 9,000 queries per connection (DEBUG in this process): a log
        # that (d) or (g) filled counts nothing new. Empty it first.
        reset_queries()
        with CaptureQueriesContext(connection) as captured:
            starter.start("queries-probe")
        counts.append(len(captured.captured_queries))
    report.row(
        "a",
        "durable SQL statements per start",
        str(counts[1]),
        f"BEGIN..COMMIT included; {counts[0]} for the first start of a key (creates its lock row); "
        "the same with the Celery dispatch (it sends after the commit)",
    )


def _drop_failed(kind: str, replies: list[dict[str, Any]], opts: Options, pool: WorkerPool, *, required: bool) -> bool:
    failed = [rep for rep in replies if "error" in rep]
    if not failed:
        return False
    pool.reset_barriers()
    error = str(failed[0]["error"]).strip()
    if required:
        raise WorkerError(f"{LABELS[kind]} failed in benchmark process {failed[0]['worker']}:\n{error}")
    opts.unavailable[kind] = error.splitlines()[-1]
    return True


# -- (b) ------------------------------------------------------------------------
#: The input of (b)'s extra row: a chat turn with its history, as the product's starts carry.
CHAT_INPUT_BYTES = 8000


def section_b(pool: WorkerPool, opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    """One hot key at its limit: refusal latency, and over-admission with and without churn."""
    n, limit = opts.starters, opts.hot_limit
    conninfo = scratch.conninfo(scratch.main)
    progress(f"(b) preparing {n} starter processes")
    pool.call(range(n), {"cmd": "prepare", "kind": "hot", "limit": limit}, timeout=600)
    parent = starters.DurableStarter()
    parent.set_hot_limit(limit)

    # Phase 1: the key is full and stays full; every start must be refused.
    # First one starter alone (the uncontended baseline), then all of them.
    key = "hot-refuse"
    _prefill(parent, key, limit)
    solo_seconds = min(2.0, opts.hot_seconds)
    progress(f"(b) refusal baseline: 1 starter on a full key for {solo_seconds:g} s")
    [solo] = pool.call([0], _storm(key, solo_seconds, 1), timeout=solo_seconds + 300)
    solo_refused = sorted(solo["refused_us"])
    progress(f"(b) refusal with a chat turn's input: 1 starter, {CHAT_INPUT_BYTES:,} bytes of input, {solo_seconds:g} s")
    [chat] = pool.call([0], _storm(key, solo_seconds, 1, CHAT_INPUT_BYTES), timeout=solo_seconds + 300)
    progress(f"(b) refusal storm: {n} starters on a full key for {opts.hot_seconds:g} s")
    replies = pool.call(range(n), _storm(key, opts.hot_seconds, n), timeout=opts.hot_seconds + 300)
    refused = sorted(us for rep in replies for us in rep["refused_us"])
    admitted = sum(len(rep["admitted_us"]) for rep in replies) + len(solo["admitted_us"])
    active = _count(conninfo, key)
    p50, p99 = _report.percentile(refused, 50), _report.percentile(refused, 99)
    report.row(
        "b",
        "refusal latency p50 / p99, 1 starter (baseline)",
        f"{_report.ms(_report.percentile(solo_refused, 50))} / {_report.ms(_report.percentile(solo_refused, 99))}",
        f"{len(solo_refused) / solo_seconds:,.0f} refusals/s",
    )
    chat_refused = sorted(chat["refused_us"])
    report.row(
        "b",
        f"extra: refusal latency p50 / p99, 1 starter, {CHAT_INPUT_BYTES // 1000} KB input",
        f"{_report.ms(_report.percentile(chat_refused, 50))} / {_report.ms(_report.percentile(chat_refused, 99))}",
        f"{len(chat_refused) / solo_seconds:,.0f} refusals/s; CPU per refusal, client / database:"
        f" {_cpu_text(_cpu_per_call([chat], len(chat_refused)))}, against {_cpu_text(_cpu_per_call([solo], len(solo_refused)))}"
        " with the baseline's input ({\"key\": ...}); a chat turn's history (starters.chat_input), no target",
    )
    rate = len(refused) / opts.hot_seconds
    report.row(
        "b",
        f"refusals ({n} starters, limit {limit}, {opts.hot_seconds:g} s)",
        f"{len(refused):,}",
        f"{rate:,.0f} /s, i.e. one per {_report.ms(1e6 / rate) if rate else '-'} on the key; admitted {admitted} (must be 0)",
    )
    report.row("b", f"refusal latency p50, {n} starters", _report.ms(p50))
    worst = f"max {_report.ms(refused[-1])}" if refused else ""
    report.row("b", f"refusal latency p99, {n} starters", _report.ms(p99), worst)
    floors, floor_cpu = _round_trip_floors(pool, opts, report, progress)
    cpu = _cpu_per_call(replies, len(refused))
    report.row(
        "b",
        f"CPU per refusal, {n} starters: client / database",
        _cpu_text(cpu),
        f"SELECT 1 through Django: {_cpu_text(floor_cpu)}; the latency under load follows"
        f" this cost ({n} processes share {os.cpu_count()} cores)",
    )
    _refusal_statement(pool, opts, report, progress, key, floors["django"], p99)
    report.row(
        "b",
        "over-admission after refusal storm",
        str(max(0, active - limit)),
        f"{active} runs in counted statuses, limit {limit}",
    )

    # Phase 2: slots free up while the starters race for them.
    key = "hot-churn"
    _prefill(parent, key, limit)
    sampler = _Sampler(conninfo, key)
    completer = _Completer(key, opts.free_rate)
    progress(f"(b) churn: {n} starters race for slots freed at ~{opts.free_rate:g}/s for {opts.hot_seconds:g} s")
    sampler.start()
    completer.start()
    try:
        replies = pool.call(range(n), _storm(key, opts.hot_seconds, n), timeout=opts.hot_seconds + 300)
    finally:
        completer.stop.set()
        completer.join()
        sampler.stop.set()
        sampler.join()
    for thread in (sampler, completer):
        if thread.error:
            raise RuntimeError(f"{thread.name} failed:\n{thread.error}")
    admitted_us = sorted(us for rep in replies for us in rep["admitted_us"])
    refused_n = sum(len(rep["refused_us"]) for rep in replies)
    final = _count(conninfo, key)
    ledger = limit + len(admitted_us) - completer.done
    high = max(sampler.high, final)
    over = max(0, high - limit)
    report.row(
        "b",
        "churn: admitted / completed / refused",
        f"{len(admitted_us):,} / {completer.done:,} / {refused_n:,}",
        f"admitted p50 {_report.ms(_report.percentile(admitted_us, 50))}, p99 {_report.ms(_report.percentile(admitted_us, 99))}",
    )
    report.row(
        "b",
        "churn: in-flight high-water mark",
        str(high),
        f"max of {sampler.samples:,} COUNT samples and the final count; limit {limit}",
    )
    report.row(
        "b",
        "churn: final in-flight",
        str(final),
        f"ledger prefill + admitted - completed = {ledger}" + ("" if ledger == final else " (MISMATCH)"),
    )
    report.row("b", "over-admission during churn", str(over), f"high-water {high} - limit {limit}, floored at 0")

    floor_note = "; ".join(f"{via} SELECT 1 p99 {_report.ms(us)}" for via, us in floors.items())
    # The refusal against the cheapest round trip through Django's cursor, as durable sends it.
    over_floor = p99 / floors["django"] if refused and floors["django"] > 0 else None
    report.target(
        "b",
        f"refusal latency p99 / Django SELECT 1 p99 ({n} starters)",
        "<= 2.00x",
        over_floor,
        over_floor is not None and over_floor <= 2.0,
        _report.ratio(over_floor) if over_floor is not None else "-",
        f"refusal p99 {_report.ms(p99)}; floor here: {floor_note}" if refused else "no refusal measured",
    )
    storm_over = max(0, active - limit)
    report.target(
        "b",
        "over-admission after refusal storm",
        "== 0",
        storm_over,
        storm_over == 0 and admitted == 0,
        str(storm_over),
        "" if admitted == 0 else f"{admitted} starts admitted on a full key",
    )
    report.target(
        "b",
        "over-admission during churn (high-water)",
        "== 0",
        over,
        over == 0 and ledger == final,
        str(over),
        "" if ledger == final else f"ledger {ledger} != final {final}",
    )


def _round_trip_floors(
    pool: WorkerPool, opts: Options, report: Report, progress: Progress
) -> tuple[dict[str, float], dict[str, float | None]]:
    """The same processes send ``SELECT 1`` instead of starting a run: the latency
    no refusal can go under on this machine, through Django's cursor (the way
    durable's statement goes) and through bare psycopg. Returns the p99 of each,
    and the CPU per call through Django (``_cpu_per_call``)."""
    n = opts.starters
    p99s = {}
    cpu: dict[str, float | None] = {}
    for via in ("django", "psycopg"):
        progress(f"(b) round-trip floor: {n} processes send SELECT 1 through {via} for {opts.hot_seconds:g} s")
        replies, latencies = _round_trips(pool, opts, via)
        p99s[via] = _report.percentile(latencies, 99)
        if via == "django":
            cpu = _cpu_per_call(replies, len(latencies))
        report.row(
            "b",
            f"floor: SELECT 1 p50 / p99, {n} procs, {via}",
            f"{_report.ms(_report.percentile(latencies, 50))} / {_report.ms(p99s[via])}",
            f"{len(latencies) / opts.hot_seconds:,.0f} /s; the cheapest round trip, same processes",
        )
    return p99s, cpu


def _round_trips(pool: WorkerPool, opts: Options, via: str, **probe: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """Every starter process sends ``via``'s statement (the worker's "roundtrip" command,
    with ``probe``'s key and limit for "statement") for ``opts.hot_seconds``: the
    replies and every call's latency (microseconds), sorted."""
    message = {"cmd": "roundtrip", "via": via, "seconds": opts.hot_seconds, "size": opts.starters, **probe}
    replies = pool.call(range(opts.starters), message, timeout=opts.hot_seconds + 300)
    return replies, sorted(us for rep in replies for us in rep["latency_us"])


def _refusal_statement(
    pool: WorkerPool, opts: Options, report: Report, progress: Progress, key: str, floor_p99: float, refusal_p99: float
) -> None:
    """The same processes send the statement a refusal of the full ``key`` sends
    (``durable_full_key``) through Django's cursor, without durable's Python around it:
    how much of the refusal's p99 over the ``SELECT 1`` floor is the database's
    statement, and how much durable's code (an extra row, no target)."""
    n = opts.starters
    progress(f"(b) the refusal's statement alone: {n} processes send it through django for {opts.hot_seconds:g} s")
    replies, latencies = _round_trips(pool, opts, "statement", key=key, limit=opts.hot_limit)
    p99 = _report.percentile(latencies, 99)
    shares = "-"
    if floor_p99 > 0 and p99 > 0:
        shares = f"{_report.ratio(p99 / floor_p99)} the Django SELECT 1 p99, the refusal {_report.ratio(refusal_p99 / p99)} this"
    report.row(
        "b",
        f"extra: the refusal's statement alone p50 / p99, {n} procs, django",
        f"{_report.ms(_report.percentile(latencies, 50))} / {_report.ms(p99)}",
        f"{len(latencies) / opts.hot_seconds:,.0f} /s; durable_full_key through Django's cursor, without durable's Python:"
        f" p99 {shares}; CPU per call, client / database: {_cpu_text(_cpu_per_call(replies, len(latencies)))}; no target",
    )


def _cpu_per_call(replies: list[dict[str, Any]], calls: int) -> dict[str, float | None]:
    """Microseconds of CPU per call in the processes' replies ("cpu"), on the client's
    side and the database's (None when a backend's could not be read: not on this machine)."""
    per_call: dict[str, float | None] = {}
    for side in ("client", "database"):
        used = [rep["cpu"][side] for rep in replies]
        per_call[side] = sum(used) * 1e6 / calls if calls and None not in used else None
    return per_call


def _cpu_text(cpu: dict[str, float | None]) -> str:
    return " / ".join("-" if cpu[side] is None else f"{cpu[side]:.0f} us" for side in ("client", "database"))


def _storm(key: str, seconds: float, size: int, input_bytes: int = 0) -> dict[str, Any]:
    return {"cmd": "storm", "key": key, "seconds": seconds, "size": size, "input_bytes": input_bytes}


def _prefill(parent: starters.DurableStarter, key: str, limit: int) -> None:
    admitted = sum(parent.start(key, workflow=starters.HOT_WORKFLOW) for _ in range(limit))
    if admitted != limit:
        raise RuntimeError(f"pre-filling {key!r} admitted {admitted} of {limit} runs")


def _count(conninfo: str, key: str) -> int:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(_COUNT, ("concurrency:" + key, list(DEFAULT_CONCURRENCY_STATUSES))).fetchone()
    return int(row[0]) if row else 0


class _Sampler(threading.Thread):
    """Counts the key's in-flight runs over and over on its own connection; keeps the maximum."""

    def __init__(self, conninfo: str, key: str) -> None:
        super().__init__(name="durable-bench-sampler", daemon=True)
        self.conninfo, self.tag = conninfo, "concurrency:" + key
        self.stop = threading.Event()
        self.high = 0
        self.samples = 0
        self.error = ""

    def run(self) -> None:
        statuses = list(DEFAULT_CONCURRENCY_STATUSES)
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                while not self.stop.is_set():
                    row = conn.execute(_COUNT, (self.tag, statuses)).fetchone()
                    self.high = max(self.high, int(row[0]) if row else 0)
                    self.samples += 1
                    self.stop.wait(0.0005)
        except Exception:
            self.error = traceback.format_exc()


class _Completer(threading.Thread):
    """Completes the key's oldest pending run about ``rate`` times a second (frees its slot)."""

    def __init__(self, key: str, rate: float) -> None:
        super().__init__(name="durable-bench-completer", daemon=True)
        self.tag = "concurrency:" + key
        self.interval = 1.0 / rate if rate > 0 else 1.0
        self.stop = threading.Event()
        self.done = 0
        self.error = ""

    def run(self) -> None:
        from django.db import connection
        from django.utils import timezone

        from durable.models import WorkflowRun
        from durable.stores.database import DjangoStore

        store = DjangoStore()
        try:
            while not self.stop.is_set():
                run_id = (
                    WorkflowRun.objects.with_tag(self.tag)
                    .filter(status="pending")
                    .order_by("id")
                    .values_list("run_id", flat=True)
                    .first()
                )
                if run_id is not None and store.transition(
                    run_id, from_statuses=["pending"], to="completed", finished_at=timezone.now()
                ):
                    self.done += 1
                self.stop.wait(self.interval)
        except Exception:
            self.error = traceback.format_exc()
        finally:
            connection.close()


# -- (c) ------------------------------------------------------------------------
def section_c(pool: WorkerPool, opts: Options, report: Report, scratch: Scratch, progress: Progress) -> None:
    """Start latency with ``finished_runs`` completed runs in the tables vs none."""
    empty_db, big_db = scratch.copies
    n = opts.finished_runs
    progress(f"(c) loading {n:,} finished runs into {big_db}")
    t0 = time.perf_counter()
    history.load_finished(scratch.conninfo(big_db), n, opts.latency_keys)
    loaded = time.perf_counter() - t0
    for name in (empty_db, big_db):
        history.vacuum_analyze(scratch.conninfo(name))
    progress(f"(c) loaded in {loaded:.0f} s; measuring")
    aliases = ["c0", "c1"]
    pool.call([0], {"cmd": "prepare", "kind": "latency", "aliases": aliases, "nkeys": opts.latency_keys}, timeout=600)
    message = {"cmd": "latency", "aliases": aliases, "starts": opts.latency_starts, "nkeys": opts.latency_keys}
    [reply] = pool.call([0], message, timeout=600)
    none = sorted(reply["latency_us"]["c0"])
    big = sorted(reply["latency_us"]["c1"])
    for label, values in (("0 finished runs", none), (f"{n:,} finished runs", big)):
        report.row(
            "c",
            f"start latency p50, {label}",
            _report.ms(_report.percentile(values, 50)),
            f"p90 {_report.ms(_report.percentile(values, 90))}, mean {_report.ms(sum(values) / len(values))}, "
            f"{len(values):,} starts",
        )
    p50_ratio = _report.percentile(big, 50) / _report.percentile(none, 50)
    mean_ratio = (sum(big) / len(big)) / (sum(none) / len(none))
    report.row(
        "c",
        "latency ratio with/without history (p50)",
        _report.ratio(p50_ratio),
        f"mean ratio {_report.ratio(mean_ratio)}",
    )
    for label, name in (("no", empty_db), (f"{n:,}", big_db)):
        plan = history.count_plan(scratch.conninfo(name), "c-k0")
        report.note(f"(c) the tag COUNT with {label} finished runs: {plan}")
        plan = history.function_count_plan(scratch.conninfo(name), "c-k0")
        report.note(f"(c) the SQL functions' count with {label} finished runs (generic plan): {plan}")
    # A tenant's own recent history: finished runs on the key itself, not yet vacuumed.
    calls = max(opts.latency_starts // 4, 50)
    progress(f"(c) durable_admit on a key with {history.KEY_HISTORY:,} finished runs not vacuumed, {calls} calls per kind")
    times = history.key_history_latency(scratch.conninfo(big_db), history.KEY_HISTORY, calls)
    for kind, label in (("refusal", "a refusal"), ("start", "an admitted start (rolled back)")):
        with_history, without = (sorted(times[kind][past]) for past in ("history", "none"))
        p50, base = _report.percentile(with_history, 50), _report.percentile(without, 50)
        report.row(
            "c",
            f"durable_admit p50, {label}: key with {history.KEY_HISTORY:,} finished runs / without",
            _report.ratio(p50 / base),
            f"{_report.ms(p50)} vs {_report.ms(base)}; the history not yet vacuumed, statistics analyzed; "
            f"{len(with_history):,} calls each, interleaved, one connection",
        )
    report.target(
        "c",
        f"start latency ratio, {n:,} finished runs vs none (p50)",
        "<= 1.15x",
        p50_ratio,
        p50_ratio <= 1.15,
        _report.ratio(p50_ratio),
        "" if n >= 1_000_000 else f"(--quick or --finished-runs: {n:,} rows, not 1,000,000)",
    )
