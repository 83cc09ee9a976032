"""``python -m bench``: measure start throughput, refusal latency, quota exactness and hand-offs.

A benchmark, not a test: it prints what it measured, ratios against baselines
measured in the same run, and one PASS/MISS line per target. It runs on
PostgreSQL only, in throw-away databases that it creates and drops (never the
project's database). It is a development tool run from the root of a durable
checkout (it sets Django up with ``testproject.settings`` and starts
``celery -A testproject`` workers), so it is no management command of the
installed app; install the competitors with ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

SECTIONS = ("a", "b", "c", "d", "e", "f", "g", "h", "i")

#: Defaults of a full run (about 10 minutes on 2 cores) and of --quick.
FULL = {
    "seconds": 3.0,
    "rounds": 5,
    "hot_seconds": 5.0,
    "finished_runs": 1_000_000,
    "latency_starts": 2000,
    "handoffs": 300,
    "grr_rounds": 3,
    "first_steps": 200,
    "g_runs": 2000,
    "g_rounds": 3,
}
QUICK = {
    "seconds": 2.0,
    "rounds": 1,
    "hot_seconds": 2.0,
    "finished_runs": 100_000,
    "latency_starts": 600,
    "handoffs": 60,
    "grr_rounds": 1,
    "first_steps": 15,
    "g_runs": 400,
    "g_rounds": 1,
}
#: The broker of sections (a), (d), (f) and (g) when neither --broker nor a Redis CELERY_BROKER_URL is given.
DEFAULT_BROKER = "redis://127.0.0.1:6379/9"
_REDIS = ("redis://", "rediss://")


class BenchError(Exception):
    """A reason the benchmark cannot run (bad options, not PostgreSQL, a failed scratch database or worker)."""


DESCRIPTION = (
    "Benchmark durable's start path on PostgreSQL in scratch databases: (a) starts/s of Wf.dispatch "
    "(Celery message to Redis) vs raw psycopg, procrastinate and DBOS; "
    "(b) a hot key at its limit (refusal latency, over-admission); "
    "(c) start latency with a million finished runs; (d) slot hand-off latency with a real Celery worker "
    "on Redis (a run completes -> the next queued run of its key starts executing); (e) GROUP_ROUND_ROBIN "
    "admission: queued starts/s against REJECT starts/s, and hand-offs/s; (f) latency from Wf.dispatch to "
    "the first step's body with a warm Celery worker, against a bare Celery task's; (g) one-step runs "
    "completed per second by one Celery worker process against procrastinate's worker; (h) the API's and "
    "the admin's lists with a big history against a small one; (i) step-level quota hand-off latency (a "
    "limited step ends -> the next waiting step's body starts) with a real Celery worker, against (d)'s run "
    "hand-off in the same worker, and a step's cost with a step quota against without."
)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Shorter run (about two minutes and a half); 100,000 rows in (c), 60 runs in (d), 1 round in (e), 400 runs in (g).",
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help="Sections to run, e.g. 'a,c' or 'd,e' (default: all).")
    parser.add_argument(
        "--db-name",
        default="durable_bench",
        help="Name of the scratch database (dropped if it exists, and at the end); (c) and DBOS add _c0, _c1 and _dbos to it.",
    )
    a = parser.add_argument_group(
        "(a) start rate",
        "Wf.dispatch with its Celery message sent to the --broker (a queue nothing consumes, purged after each "
        "round), against raw psycopg, procrastinate defer and DBOS enqueue; Engine.start with a no-op dispatch "
        "as an extra row (a shortcut: its runs never execute).",
    )
    a.add_argument("--seconds", type=float, help="Seconds per configuration and round (full 3, quick 2).")
    a.add_argument("--rounds", type=int, help="Rounds over all configurations (full 5, quick 1).")
    a.add_argument("--procs", default="1,4", help="Process counts of (a) and (e) (default 1,4).")
    a.add_argument("--keys", type=int, default=100, help="Keys per process, new each round, started round-robin (default 100).")
    b = parser.add_argument_group("(b) hot key")
    b.add_argument("--starters", type=int, default=16, help="Concurrent starter processes (default 16).")
    b.add_argument("--hot-limit", type=int, default=10, help="Limit of the hot key (default 10).")
    b.add_argument("--hot-seconds", type=float, help="Seconds per phase (full 5, quick 2).")
    b.add_argument("--free-rate", type=float, default=100.0, help="Slots freed per second in the churn phase.")
    c = parser.add_argument_group("(c) big history")
    c.add_argument(
        "--finished-runs",
        type=int,
        help="Finished runs loaded in (c), and runs in (h) on a tenth as many keys (full 1,000,000, quick 100,000).",
    )
    c.add_argument(
        "--latency-starts",
        type=int,
        help="Timed starts per database, alternating between the two (full 2000, quick 600).",
    )
    d = parser.add_argument_group(
        "(d) hand-off latency",
        "A real worker (celery -A testproject worker --pool=threads, one thread per key) on a queue of its own, "
        "on the scratch database, runs a GROUP_ROUND_ROBIN workflow of limit 1 whose runs are all queued "
        "behind the first of their key; each hand-off is timed from the run's finished_at to the next run's "
        "body start. Measured twice, each with a new worker: with the test project's database settings (a new "
        "connection per task; the target: p50 <= 50 ms), then with Django's connection pool (?pool=true).",
    )
    d.add_argument(
        "--broker",
        help=f"Redis URL of the broker of (a), (d), (f) and (g) "
        f"(default: CELERY_BROKER_URL if it is a Redis URL, else {DEFAULT_BROKER}).",
    )
    d.add_argument(
        "--handoffs", type=int, help="Runs started; hand-offs = runs - keys (full 300, quick 60); (i) too, on one key."
    )
    d.add_argument(
        "--handoff-keys",
        type=int,
        default=1,
        help="Keys: 1 (default) is one chain of hand-offs; more keys run that many chains in parallel in the "
        "one worker, which then also measures its contention (its threads share the GIL and the CPUs).",
    )
    e = parser.add_argument_group(
        "(e) GROUP_ROUND_ROBIN admission",
        "Keys at their limit (1), then queued starts through Engine.start, against REJECT starts on fresh keys "
        "in the same run (ratio, informational); then every queued run is handed its slot by completing runs "
        "(Promoter.promote), as hand-offs/s.",
    )
    e.add_argument("--queued-runs", type=int, default=1000, help="Starts queued per configuration (default 1,000).")
    e.add_argument("--queued-keys", type=int, default=50, help="Keys they are queued on (default 50).")
    e.add_argument("--grr-rounds", type=int, help="Rounds over the process counts (full 3, quick 1).")
    f = parser.add_argument_group(
        "(f) dispatch to first step",
        "A warm Celery worker (threads pool, then prefork; each with a connection per task, then Django's pool) "
        "on Redis: from Wf.dispatch to its first step's body, against a bare Celery task that makes one committed "
        "write, from apply_async to that write committed, and the same task sent after a committed INSERT "
        "(the floor of a start that commits before it sends), interleaved; target: p50 <= 1.2x the bare task's.",
    )
    f.add_argument("--first-steps", type=int, help="Samples of each kind per configuration (full 200, quick 15).")
    g = parser.add_argument_group(
        "(g) execution throughput",
        "Runs of a one-step no-op workflow pre-loaded, then executed by one Celery worker process (threads pool, "
        "concurrency 4; a connection per task, then Django's pool), against the same no-op job deferred to "
        "procrastinate and run by its worker (concurrency 4), interleaved; timed from the first completion to the "
        "last; target: >= 1.0x procrastinate's runs/s.",
    )
    g.add_argument("--g-runs", type=int, help="Runs (and jobs) per kind and round (full 2,000, quick 400).")
    g.add_argument("--g-rounds", type=int, help="Rounds over the kinds (full 3, quick 1).")

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; the exit status (0, or 1 after printing why it could not run)."""
    try:
        _run(vars(parser().parse_args(argv)))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _run(options: dict[str, Any]) -> None:
    resolved = _resolve(options)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    from django.db import connection

    if connection.vendor != "postgresql":
        raise BenchError(
            f"the benchmark runs on PostgreSQL only; the 'default' database is {connection.vendor}. "
            "Point it at a PostgreSQL server, e.g. DATABASE_URL=postgres://user@host:5432/db."
        )
    from bench import runner, sections
    from bench.pool import WorkerError
    from bench.scratch import ScratchError

    opts = sections.Options(**resolved)
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the scratch
    # databases and the benchmark processes are still cleaned up.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = runner.run(opts, _progress)
    except (ScratchError, WorkerError) as exc:
        raise BenchError(str(exc)) from exc
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.stdout.write(report.render())


def _progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"python -m bench stopped by signal {signum}")


def _resolve(options: dict[str, Any]) -> dict[str, Any]:
    only = tuple(s.strip().lower() for s in str(options["only"]).split(",") if s.strip())
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown or not only:
        raise BenchError(f"--only takes sections among {', '.join(SECTIONS)}, got {options['only']!r}.")
    try:
        procs = tuple(sorted({int(p) for p in str(options["procs"]).split(",") if p.strip()}))
    except ValueError:
        raise BenchError(f"--procs takes process counts like '1,4', got {options['procs']!r}.") from None
    profile = QUICK if options["quick"] else FULL
    values = {k: options[k] if options.get(k) is not None else v for k, v in profile.items()}
    for name in (
        "keys",
        "starters",
        "hot_limit",
        "rounds",
        "latency_starts",
        "handoff_keys",
        "queued_runs",
        "queued_keys",
        "grr_rounds",
        "first_steps",
        "g_runs",
        "g_rounds",
    ):
        value = options.get(name) if options.get(name) is not None else values.get(name)
        if value is not None and int(value) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    if not procs or min(procs) < 1:
        raise BenchError(f"--procs takes positive process counts, got {options['procs']!r}.")
    if options["finished_runs"] is not None and options["finished_runs"] < 0:
        raise BenchError("--finished-runs must be 0 or more.")
    if values["handoffs"] <= options["handoff_keys"]:
        raise BenchError(
            f"--handoffs must be more than --handoff-keys ({options['handoff_keys']}): the first run of each key "
            f"is not a hand-off; got {values['handoffs']}."
        )
    broker, source = _broker(options.get("broker"))
    return {
        "quick": bool(options["quick"]),
        "only": tuple(s for s in SECTIONS if s in only),
        "db_name": str(options["db_name"]),
        "procs": procs,
        "keys": int(options["keys"]),
        "starters": int(options["starters"]),
        "hot_limit": int(options["hot_limit"]),
        "free_rate": float(options["free_rate"]),
        "broker": broker,
        "broker_source": source,
        "handoff_keys": int(options["handoff_keys"]),
        "queued_runs": int(options["queued_runs"]),
        "queued_keys": int(options["queued_keys"]),
        "pool_queue": f"durable-bench-{os.getpid()}-pool",
        **values,
    }


def _broker(option: str | None) -> tuple[str, str]:
    """The broker and where it came from: --broker, a Redis CELERY_BROKER_URL, or the default."""
    if option:
        if not option.startswith(_REDIS):
            raise BenchError(f"--broker takes a Redis URL (redis://host:port/db), got {option!r}.")
        return option, "--broker"
    env = os.environ.get("CELERY_BROKER_URL", "")
    if env.startswith(_REDIS):
        return env, "CELERY_BROKER_URL"
    return DEFAULT_BROKER, "default" + ("; CELERY_BROKER_URL is not a Redis URL" if env else "")


if __name__ == "__main__":
    sys.exit(main())
