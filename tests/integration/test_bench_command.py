"""Smoke tests of the benchmark, ``python -m bench`` from the checkout: it runs and reports; no timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.core.management import get_commands
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parents[2]
_OVER_ROW = re.compile(r"^b\s+over-admission after refusal storm\s+(?P<count>\d+)\s")


def run_bench(*args: str, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m bench <args>`` from the checkout's root, in a subprocess (without the variables ``unset``)."""
    env = {k: v for k, v in os.environ.items() if k not in unset} | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "bench", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def bench(scratch: str, *args: str) -> list[str]:
    """``python -m bench --quick --db-name <scratch> <args>``; its output lines."""
    done = run_bench("--quick", "--db-name", scratch, *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "targets" in lines
    return lines


def targets(lines: list[str]) -> list[str]:
    return lines[lines.index("targets") + 1 :]


def databases_left(scratch: str) -> list[tuple[str]]:
    db = settings.DATABASES["default"]
    params = {"host": db.get("HOST"), "port": db.get("PORT"), "user": db.get("USER"), "password": db.get("PASSWORD")}
    conninfo = make_conninfo("", dbname="postgres", **{k: str(v) for k, v in params.items() if v})
    with psycopg.connect(conninfo) as conn:
        return conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (scratch + "%",)).fetchall()


def row(lines: list[str], section: str, what: str, value: str) -> re.Match[str] | None:
    """The first table row of ``section`` whose measurement starts with ``what`` and
    whose value matches the regular expression ``value``."""
    pattern = re.compile(rf"^{section}\s+{re.escape(what)}.*?\s{{2,}}(?P<value>{value})(\s{{2}}|$)")
    return next((m for m in map(pattern.match, lines) if m), None)


@pytest.mark.postgres
def test_smallest_run_prints_targets_and_over_admission_and_drops_its_database() -> None:
    scratch = f"durable_bench_smoke_{os.getpid()}"
    lines = bench(scratch, "--only", "b", "--starters", "2", "--hot-limit", "3", "--hot-seconds", "0.3")

    rows = [m for m in map(_OVER_ROW.match, lines) if m]
    assert len(rows) == 1
    assert rows[0]["count"] == "0"  # quota exactness, not speed: no run beyond the limit
    for via in ("django", "psycopg"):  # the round-trip floor, measured by the same 2 processes
        assert row(lines, "b", f"floor: SELECT 1 p50 / p99, 2 procs, {via}", r"[\d.]+ ms / [\d.]+ ms")
    # A refusal whose start carries a chat turn's input: its CPU beside the baseline's.
    chat = row(lines, "b", "extra: refusal latency p50 / p99, 1 starter, 8 KB input", r"[\d.]+ ms / [\d.]+ ms")
    cpu = r"CPU per refusal, client / database: \d+ us / (\d+ us|-), against \d+ us / (\d+ us|-)"
    assert chat and re.search(cpu, chat.string)
    # The refusal's statement alone (the processes' worker checks that it refuses): its share of the ratio.
    alone = row(lines, "b", "extra: the refusal's statement alone p50 / p99, 2 procs, django", r"[\d.]+ ms / [\d.]+ ms")
    shares = r"p99 \d+\.\d\dx the Django SELECT 1 p99, the refusal \d+\.\d\dx this; CPU per call, client / database: \d+ us"
    assert alone and re.search(shares, alone.string)
    [refusal] = [line for line in targets(lines) if "refusal latency p99" in line]
    # A ratio to the floor measured in the same run, not an absolute latency.
    assert re.search(r"refusal latency p99 / Django SELECT 1 p99 \(2 starters\) <= 2\.00x\s+measured \d+\.\d\dx", refusal)
    assert re.search(r"floor here: django SELECT 1 p99 [\d.]+ ms; psycopg SELECT 1 p99 [\d.]+ ms", refusal)
    verdicts = [line.split()[0] for line in targets(lines)]
    assert verdicts and set(verdicts) <= {"PASS", "MISS", "N/A"}
    assert len(verdicts) == 3  # refusal p99, over-admission after the storm, during churn
    assert databases_left(scratch) == []


@pytest.mark.postgres
def test_read_side_section_times_every_list_and_drops_its_databases() -> None:
    scratch = f"durable_bench_read_{os.getpid()}"
    lines = bench(scratch, "--only", "h", "--finished-runs", "3000")
    for what in ("API GET runs/,", "API GET quotas/,", "admin run list,", "admin run list, running,", "admin quota list,"):
        assert row(lines, "h", f"{what} 3,000 runs vs 1,000", r"[\d.]+x"), what
    verdicts = [line.split()[0] for line in targets(lines)]
    assert len(verdicts) == 8 and set(verdicts) <= {"PASS", "MISS"}
    assert all("<= 1.2x" in line for line in targets(lines))
    assert databases_left(scratch) == []


@pytest.mark.postgres
def test_group_round_robin_section_prints_rates_ratio_and_hand_offs() -> None:
    scratch = f"durable_bench_grr_{os.getpid()}"
    lines = bench(scratch, "--only", "e", "--procs", "1", "--queued-runs", "40", "--queued-keys", "5")

    assert row(lines, "e", "queued GROUP_ROUND_ROBIN starts, 1 proc", r"[\d,]+ /s")
    assert row(lines, "e", "REJECT starts (durable_admit), 1 proc", r"[\d,]+ /s")
    assert row(lines, "e", "ratio queued GRR / REJECT, 1 proc", r"\d+\.\d\dx")
    statements = row(
        lines, "e", "SQL statements: REJECT start / queued start / hand-off / one-step run executed", r"\d+ / \d+ / \d+ / \d+"
    )
    assert statements is not None
    assert all(int(n) > 0 for n in statements["value"].split(" / "))
    handoffs = row(lines, "e", "hand-offs (finish a run + the promote on commit), 1 proc", r"[\d,]+ /s")
    assert handoffs is not None
    # Exactness, not speed: every queued run was handed a slot.
    assert "40 hand-offs" in handoffs.string and "queued runs left 0 " in handoffs.string
    assert row(lines, "e", "ratio hand-offs / REJECT starts, 1 proc", r"\d+\.\d\dx")
    printed = targets(lines)
    # Speed is judged against this run's REJECT starts (PASS or MISS); the statement counts are not speed.
    assert [line.split()[1] for line in printed] == ["(e)"] * 5
    assert all(line.split()[0] in ("PASS", "MISS") for line in printed[:3]), printed
    assert [line.split()[0] for line in printed[3:]] == ["PASS", "PASS"], printed
    assert "SQL statements of a queued GRR start" in printed[3] and "hand-off (finish + promote)" in printed[4]
    assert databases_left(scratch) == []


@pytest.mark.postgres
@pytest.mark.worker
def test_hand_off_section_runs_a_celery_worker_and_prints_the_latencies() -> None:
    if not os.environ.get("CELERY_BROKER_URL", "").startswith("redis://"):
        pytest.skip("section (d) runs a Celery worker on Redis: set CELERY_BROKER_URL=redis://...")
    scratch = f"durable_bench_handoff_{os.getpid()}"
    lines = bench(scratch, "--only", "d", "--handoffs", "6")

    assert row(lines, "d", "hand-offs per worker configuration", "5")
    for name in ("per task", "pooled"):
        assert row(lines, "d", f"slot hand-off latency p50 / p99, {name}", r"[\d.]+ ms / [\d.]+ ms")
        assert row(lines, "d", f"  runs of a key overlapping, {name}", "0")  # limit 1 held, not speed
    [verdict] = [line.split()[0] for line in targets(lines) if "(d)" in line]
    assert verdict in ("PASS", "MISS")  # measured, whichever way
    assert databases_left(scratch) == []


@pytest.mark.postgres
@pytest.mark.worker
def test_step_hand_off_section_prints_the_step_and_run_hand_offs() -> None:
    if not os.environ.get("CELERY_BROKER_URL", "").startswith("redis://"):
        pytest.skip("section (i) runs a Celery worker on Redis: set CELERY_BROKER_URL=redis://...")
    scratch = f"durable_bench_steps_{os.getpid()}"
    lines = bench(scratch, "--only", "i", "--handoffs", "6")

    assert row(lines, "i", "step hand-off latency p50 / p99", r"[\d.]+ ms / [\d.]+ ms")
    assert row(lines, "i", "run hand-off latency p50 / p99, as (d)", r"[\d.]+ ms / [\d.]+ ms")
    assert row(lines, "i", "  steps of the key overlapping", "0")  # limit 1 held, not speed
    [target] = [line for line in targets(lines) if "(i)" in line]
    assert target.split()[0] == "INFO" and re.search(r"measured \d+\.\d\dx", target)
    assert databases_left(scratch) == []


def redis_broker() -> str:
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not broker.startswith("redis://"):
        pytest.skip("this section sends Celery messages to Redis: set CELERY_BROKER_URL=redis://...")
    return broker


@pytest.mark.postgres
@pytest.mark.worker
def test_start_rate_section_dispatches_to_redis_and_prints_the_shortcut_apart() -> None:
    import redis

    broker = redis_broker()
    scratch = f"durable_bench_rate_{os.getpid()}"
    lines = bench(scratch, "--only", "a", "--procs", "1", "--seconds", "0.5")

    assert row(lines, "a", "durable Wf.dispatch (Celery message to Redis), 1 proc", r"[\d,]+ /s")
    assert row(lines, "a", "shortcut: Engine.start, no-op dispatch (runs never execute), 1 proc", r"[\d,]+ /s")
    assert row(lines, "a", "raw psycopg transaction, 1 proc", r"[\d,]+ /s")
    assert row(lines, "a", "ratio dispatch/raw, 1 proc", r"\d+\.\d\dx")
    sync = "option: Wf.dispatch, message sent on the caller's thread (PUBLISH_IN_BACKGROUND off), 1 proc"
    assert row(lines, "a", sync, r"[\d,]+ /s")
    threaded = "option: Wf.dispatch, each message through the publisher's thread (no direct writes), 1 proc"
    assert row(lines, "a", threaded, r"[\d,]+ /s")
    assert row(lines, "a", "ratio dispatch/option through the publisher's thread, 1 proc", r"\d+\.\d\dx")
    unbatched = "option: Wf.dispatch through the publisher's thread, each batch at once (PUBLISH_BATCH_INTERVAL 0), 1 proc"
    assert row(lines, "a", unbatched, r"[\d,]+ /s")
    assert row(lines, "a", "ratio dispatch/option each batch at once, 1 proc", r"\d+\.\d\dx")
    kombus = "option: Wf.dispatch, each message built by kombu (no templates), 1 proc"
    assert row(lines, "a", kombus, r"[\d,]+ /s")
    assert row(lines, "a", "ratio dispatch/option each message built by kombu, 1 proc", r"\d+\.\d\dx")
    prepared = "option: Wf.dispatch, prepared statements (OPTIONS server_side_binding, prepare_threshold 5), 1 proc"
    assert row(lines, "a", prepared, r"[\d,]+ /s")
    assert row(lines, "a", "ratio dispatch/option prepared statements, 1 proc", r"\d+\.\d\dx")
    # Every message sent reached the broker's queue (nothing consumed it) by the end of its
    # round, in the six rounds (written by the caller, the background publisher's thread's with
    # and without its batch interval, without its templates, on a connection with prepared
    # statements, and apply_async's on the caller's thread); then removed.
    [note] = [line for line in lines if "messages in the Redis queue" in line]
    found = re.search(r"queue (?P<queue>\S+) after each round [^:]*: (?P<rounds>.*)$", note)
    assert found is not None, note
    rounds = re.findall(r"(\d+(?:,\d{3})*) of (\d+(?:,\d{3})*)", found["rounds"])
    assert len(rounds) == 6, note
    assert all(length == sent and int(sent.replace(",", "")) > 0 for length, sent in rounds), note
    assert redis.Redis.from_url(broker).llen(found["queue"]) == 0
    raw, procrastinate = targets(lines)
    assert "(a) dispatch/raw starts at 1 processes >= 0.90x" in raw
    assert raw.split()[0] in ("PASS", "MISS")  # measured, whichever way
    assert "(a) dispatch/procrastinate defer at 1 process >= 1.00x" in procrastinate
    # Measured, or not applicable because procrastinate is not installed (the reason is printed).
    assert procrastinate.split()[0] in ("PASS", "MISS") or "procrastinate is not installed" in procrastinate
    assert databases_left(scratch) == []


@pytest.mark.postgres
@pytest.mark.worker
def test_dispatch_to_first_step_section_runs_workers_and_prints_latencies_against_a_bare_task() -> None:
    redis_broker()
    scratch = f"durable_bench_first_{os.getpid()}"
    lines = bench(scratch, "--only", "f", "--first-steps", "3")

    configurations = [f"{pool}, {db}" for pool in ("threads", "prefork") for db in ("per task", "pooled")]
    option = "threads, per task, KEEP_WORKER_CONNECTION off"  # an extra configuration, without a target
    threaded = ", each message through the publisher's thread (no direct writes)"
    busy = ", the sender computing 2 ms after each call"
    for label in [*configurations, option, f"threads, pooled{busy}"]:
        found = row(lines, "f", f"dispatch -> first step p50 / p99, {label}", r"[\d.]+ ms / [\d.]+ ms")
        assert found
        # The caller wrote each measured message itself (the first two, warming up, taught the template).
        assert found.string.endswith("message written by the caller for 3 of 3"), found.string
        assert row(lines, "f", f"bare task -> its write committed p50 / p99, {label}", r"[\d.]+ ms / [\d.]+ ms")
        # The floor of a start that commits before it sends: the bare task after a committed INSERT.
        outbox = row(lines, "f", f"outbox task -> its write committed p50 / p99, {label}", r"[\d.]+ ms / [\d.]+ ms")
        assert outbox
        assert re.search(r"after a committed INSERT on the sender's connection; that call p50 [\d.]+ ms$", outbox.string)
    for label in configurations:  # what the outbox floor leaves, for the configurations with a target
        assert row(lines, "f", f"ratio outbox task / bare task p50, {label}", r"[\d.]+x")
        assert row(lines, "f", f"ratio dispatch -> first step / outbox task p50, {label}", r"[\d.]+x")
    for label in [f"threads, pooled{threaded}", f"threads, pooled{busy}{threaded}"]:
        found = row(lines, "f", f"dispatch -> first step p50 / p99, {label}", r"[\d.]+ ms / [\d.]+ ms")
        assert found
        # The background publisher's hop, measured for every dispatch sample.
        hop = r"for 0 of 3; through the publisher's thread: it read the broker's reply to its batch p50 -?[\d.]+ ms after"
        assert re.search(hop, found.string), found.string
        assert row(lines, "f", f"ratio dispatch -> first step / bare task p50, {label}", r"[\d.]+x")
    # When the message reached the queue, stamped by a listener in the benchmark's own process.
    senders = ["the sender waiting after each call"] + [f"the sender computing {ms} ms after each call" for ms in (2, 10, 30)]
    senders += [f"the sender waiting after each call{threaded}", f"the sender computing 2 ms after each call{threaded}"]
    for sender in senders:
        label = f"dispatch's message in the queue after the call returned p50 / p90, {sender}"
        found = row(lines, "f", label, r"-?[\d.]+ ms / -?[\d.]+ ms")
        assert found
        assert re.search(r"3 dispatches, one at a time; a listener's BLPOP stamps each message's arrival$", found.string)
    lines_f = [line for line in targets(lines) if "(f)" in line]
    assert [line.split("(f) ")[1].split(" <=")[0] for line in lines_f] == [
        f"dispatch -> first step p50 / bare task p50, {label}" for label in configurations
    ]
    assert {line.split()[0] for line in lines_f} <= {"PASS", "MISS"}  # measured, whichever way
    assert all("<= 1.20x" in line for line in lines_f)
    assert row(lines, "f", f"ratio dispatch -> first step / bare task p50, {option}", r"[\d.]+x")
    assert databases_left(scratch) == []


@pytest.mark.postgres
@pytest.mark.worker
def test_throughput_section_runs_both_workers_and_prints_rates_and_ratios() -> None:
    redis_broker()
    pytest.importorskip("procrastinate")
    scratch = f"durable_bench_g_{os.getpid()}"
    lines = bench(scratch, "--only", "g", "--g-runs", "20")

    option = "per task, KEEP_WORKER_CONNECTION off"  # an extra configuration, without a target
    for kind in ("durable, per task", "durable, pooled", f"durable, {option}", "procrastinate"):
        assert row(lines, "g", f"one-step runs/s, {kind}", r"[\d,]+ /s")
    assert row(lines, "g", f"ratio durable worker / procrastinate worker, {option}", r"[\d.]+x")
    lines_g = [line for line in targets(lines) if "(g)" in line]
    assert [line.split("(g) ")[1].split(" >=")[0] for line in lines_g] == [
        f"durable worker / procrastinate worker, runs/s, {db}" for db in ("per task", "pooled")
    ]
    assert {line.split()[0] for line in lines_g} <= {"PASS", "MISS"}  # measured, whichever way
    assert all(">= 1.00x" in line for line in lines_g)
    assert databases_left(scratch) == []


def test_hand_off_section_takes_only_a_redis_broker() -> None:
    done = run_bench("--only", "d", "--broker", "amqp://guest@localhost//")
    assert done.returncode == 1
    assert "--broker takes a Redis URL" in done.stderr
    assert done.stdout == ""


def test_refuses_sqlite() -> None:
    done = run_bench("--quick", "--only", "b", unset=("DATABASE_URL",))  # the test project's default: SQLite
    assert done.returncode == 1
    assert "PostgreSQL only; the 'default' database is sqlite" in done.stderr
    assert done.stdout == ""


def test_the_benchmark_is_no_management_command() -> None:
    """The benchmark is no management command: in a user's project it could only fail (it
    needs the checkout). durable installs one command, the operator's ``durable``."""
    commands = get_commands()
    assert "durable_bench" not in commands
    assert sorted(name for name, app in commands.items() if app == "durable") == ["durable"]


def test_the_option_rows_of_a_leave_the_default_publisher_to_the_sections_after_them(settings) -> None:
    """(a)'s option row turns PUBLISH_IN_BACKGROUND off for its rounds only: (f), later in
    the same benchmark process, measures the default dispatch (it measured this option
    before the setting was put back)."""
    from bench import starters
    from durable.conf import settings as durable_settings

    settings.DURABLE = {"TASK_QUEUE": "q"}
    starter = starters.DispatchStarter(background=False)
    starter.begin()
    assert (durable_settings.PUBLISH_IN_BACKGROUND, durable_settings.TASK_QUEUE) == (False, "q")
    starter.end()
    assert settings.DURABLE == {"TASK_QUEUE": "q"}
    assert durable_settings.PUBLISH_IN_BACKGROUND is True
    unbatched = starters.DispatchStarter(batch_interval=0)
    unbatched.begin()
    assert (durable_settings.PUBLISH_IN_BACKGROUND, durable_settings.PUBLISH_BATCH_INTERVAL) == (True, 0)
    unbatched.end()
    assert settings.DURABLE == {"TASK_QUEUE": "q"}
    assert durable_settings.PUBLISH_BATCH_INTERVAL == 0.005
