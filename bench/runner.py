"""One benchmark run: scratch databases, competitors' schemas, worker processes, sections."""

from __future__ import annotations

import os
import time

from django.db import connection

from bench import broker, dispatching, queueing, readside, sections, starters, stepping, throughput
from bench.pool import WorkerPool
from bench.report import Report
from bench.scratch import scratch_databases
from bench.sections import Options, Progress


def run(opts: Options, progress: Progress) -> Report:
    report = Report()
    started = time.perf_counter()
    main = opts.db_name
    copies = [f"{main}_c0", f"{main}_c1"] if "c" in opts.only else []
    dbos_db = f"{main}_dbos"
    empty = [dbos_db] if "a" in opts.only else []
    others = f" and {', '.join(copies + empty)}" if copies or empty else ""
    progress(f"creating scratch database {main} (migrations){others}")
    with scratch_databases(main, copies=copies, empty=empty) as scratch:
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            version = cursor.fetchone()[0]
        params = scratch.params
        report.header.append(
            f"python -m bench: PostgreSQL {version} at {params.get('host', 'localhost')}:{params.get('port', 5432)}; "
            f"scratch databases {', '.join([main, *copies, *empty])} (dropped at the end)"
        )
        report.header.append(_describe(opts))
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        report.header.append(
            f"machine: {os.cpu_count()} CPUs, load average {load:.1f} at the start (other work on the machine "
            "slows every section)"
        )
        # procrastinate is a baseline of (a) and (g), DBOS of (a).
        for kind, needed_by, install in (
            ("procrastinate", "ag", lambda: starters.install_procrastinate(scratch.conninfo(main))),
            ("dbos", "a", lambda: starters.install_dbos(scratch.url(dbos_db))),
        ):
            if set(needed_by) & set(opts.only):
                progress(f"setting up {kind}")
                reason = install()
                if reason:
                    opts.unavailable[kind] = reason
                    progress(f"{kind} left out: {reason}")
        config = {
            "aliases": {"default": main, **dict(zip(("c0", "c1"), copies, strict=False))},
            "conninfo": scratch.conninfo(main),
            "dbos_url": scratch.url(dbos_db),
            "broker": opts.broker,
            "queue": opts.pool_queue,
        }
        if "d" in opts.only:
            # No benchmark process: the Celery worker is the process that matters.
            t0 = time.perf_counter()
            queueing.section_d(opts, report, scratch, progress)
            progress(f"(d) done in {time.perf_counter() - t0:.0f} s")
        if "i" in opts.only:
            # No benchmark process: the Celery worker is the process that matters.
            t0 = time.perf_counter()
            stepping.section_i(opts, report, scratch, progress)
            progress(f"(i) done in {time.perf_counter() - t0:.0f} s")
        if "g" in opts.only:
            # No benchmark process: the workers are the processes that matter.
            t0 = time.perf_counter()
            throughput.section_g(opts, report, scratch, progress)
            progress(f"(g) done in {time.perf_counter() - t0:.0f} s")
        pooled = [name for name in opts.only if name not in ("d", "g", "h", "i")]
        if pooled:
            size = max([max(opts.procs)] * bool({"a", "e"} & set(pooled)) + [opts.starters] * ("b" in pooled) + [1])
            progress(f"spawning {size} benchmark process(es)")
            pool = WorkerPool(size, config, barrier_sizes=[*opts.procs, opts.starters, 1])
            try:
                for name, section in (
                    ("a", sections.section_a),
                    ("b", sections.section_b),
                    ("c", sections.section_c),
                    ("e", queueing.section_e),
                    ("f", dispatching.section_f),
                ):
                    if name in pooled:
                        t0 = time.perf_counter()
                        section(pool, opts, report, scratch, progress)
                        progress(f"({name}) done in {time.perf_counter() - t0:.0f} s")
            finally:
                pool.close()
                if {"a", "f"} & set(pooled):
                    app = broker.broker_app(opts.broker)
                    broker.delete_queue(app, opts.pool_queue)
                    app.close()
        if "h" in opts.only:
            # In this process: Django's test client against the section's own database.
            t0 = time.perf_counter()
            readside.section_h(opts, report, scratch, progress)
            progress(f"(h) done in {time.perf_counter() - t0:.0f} s")
        connection.close()
    report.header.append(f"wall time {time.perf_counter() - started:.0f} s")
    return report


def _describe(opts: Options) -> str:
    parts = []
    if "a" in opts.only:
        parts.append(
            f"(a) {opts.rounds} round(s) x {opts.seconds:g} s per config, processes {','.join(map(str, opts.procs))}, "
            f"{opts.keys} new keys per process each round, dispatch's Celery messages to {_sanitize(opts.broker)}"
        )
    if "b" in opts.only:
        parts.append(f"(b) {opts.starters} starters, limit {opts.hot_limit}, {opts.hot_seconds:g} s per phase")
    if "c" in opts.only:
        parts.append(f"(c) {opts.finished_runs:,} finished runs, {opts.latency_starts:,} starts per database, alternating")
    if "d" in opts.only:
        parts.append(
            f"(d) {opts.handoffs} runs on {opts.handoff_keys} key(s), Celery worker on {_sanitize(opts.broker)} "
            f"({opts.broker_source})"
        )
    if "i" in opts.only:
        parts.append(f"(i) {opts.handoffs} runs per chain, Celery worker on {_sanitize(opts.broker)} ({opts.broker_source})")
    if "g" in opts.only:
        parts.append(f"(g) {opts.g_runs:,} runs per kind, {opts.g_rounds} round(s), workers on {_sanitize(opts.broker)}")
    if "h" in opts.only:
        parts.append(f"(h) {readside.SMALL_RUNS:,} then {opts.finished_runs:,} runs, a key per {readside.RUNS_PER_KEY} runs")
    if "e" in opts.only:
        parts.append(
            f"(e) {opts.queued_runs:,} queued runs on {opts.queued_keys} keys, {opts.grr_rounds} round(s), "
            f"processes {','.join(map(str, opts.procs))}"
        )
    if "f" in opts.only:
        parts.append(f"(f) {opts.first_steps} samples per configuration, Celery workers on {_sanitize(opts.broker)}")
    return f"mode: {'quick' if opts.quick else 'full'}; " + "; ".join(parts)


def _sanitize(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url))
