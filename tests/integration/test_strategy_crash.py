"""A real Celery worker dies while its run holds the only slot of a GROUP_ROUND_ROBIN key.

The run queued behind it must wait until the dead run is recovered and finishes,
or is given up as ``dead``, and then start at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable import DEFAULT_CONCURRENCY_STATUSES, RunHandle, RunStatus, engine
from durable.exceptions import RunFailedError
from durable.testing import wait_for
from testproject.celery import app as celery_app

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "durable-strategy-crash-test"
MAX_ATTEMPTS = 2


@pytest.fixture
def worker_env(settings: Any) -> dict[str, str]:
    # A queue of its own: no other worker (in-process or another test's) takes these runs.
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": QUEUE}
    broker = celery_app.conf.broker_url
    if not broker.startswith("redis://"):
        pytest.skip("needs a Redis broker shared with a worker process: set CELERY_BROKER_URL")
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_purge(QUEUE)  # what an earlier run may have left
    db = settings.DATABASES["default"]
    return {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "DURABLE_HEARTBEAT_INTERVAL": "0.2",
        "DURABLE_STALE_AFTER": "2",
        "DURABLE_SWEEP_INTERVAL": "0.5",
        "DURABLE_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
        "DURABLE_TASK_QUEUE": QUEUE,
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def start_worker(env: dict[str, str], tmp_path: Path, name: str, *, beat: bool, pool: str = "solo") -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "celery", "-A", "testproject", "worker", f"--pool={pool}", "--concurrency=1",
            "--loglevel=INFO", f"--hostname={name}@%h", "--without-gossip", "--without-mingle",
            "--include=tests.workflows", f"--queues={QUEUE}"]  # fmt: skip
    if beat:
        args += ["--beat", f"--schedule={tmp_path / 'beat-schedule'}"]
    with open(tmp_path / f"{name}.log", "wb") as log:  # the child keeps its own copy of the handle
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class Slot:
    """Runs of ``test.slot_holder`` on one fresh key (limit 1), logging to one file."""

    def __init__(self, tmp_path: Path) -> None:
        self.key = f"slot:{uuid.uuid4().hex[:8]}"
        self.log = tmp_path / "calls.log"
        self.release = tmp_path / "release"

    def start(self, name: str, *, die: bool = False) -> RunHandle:
        input = {"key": self.key, "name": name, "log": str(self.log), "release": str(self.release), "die": die}
        return engine.start("test.slot_holder", input)

    def lines(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def in_flight(self) -> int:
        return engine.count_runs(tag=f"concurrency:{self.key}", statuses=DEFAULT_CONCURRENCY_STATUSES)


def assert_b_ran_only_after_a(a: RunHandle, b: RunHandle) -> None:
    assert a.record.finished_at is not None and b.record.started_at is not None
    assert b.record.started_at >= a.record.finished_at


def test_killed_slot_holder_recovers_then_the_queued_run_starts(
    worker_env: dict[str, str], workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    slot = Slot(tmp_path)
    workers.append(start_worker(worker_env, tmp_path, "first", beat=False))
    a = slot.start("A")
    wait_for(lambda: "A:start" in slot.lines(), timeout=60, what="run A to hold the slot on the first worker")
    b = slot.start("B")
    assert b.status == RunStatus.QUEUED  # the key is full: B waits, holding no slot

    os.killpg(workers[0].pid, signal.SIGKILL)  # the worker dies in A's step, A still holds the slot
    workers[0].wait(timeout=10)
    assert a.refresh().status == RunStatus.RUNNING
    assert b.refresh().status == RunStatus.QUEUED
    assert slot.in_flight() == 1

    slot.release.touch()
    workers.append(start_worker(worker_env, tmp_path, "second", beat=True))
    assert a.result(timeout=90) == {"held": "A"}  # the sweeper saw A orphaned, the second worker resumed it
    assert b.result(timeout=60) == {"held": "B"}  # A's release handed its slot to B

    assert slot.lines() == ["A:start", "A:start", "A:end", "B:start", "B:end"]
    assert (a.record.attempt, b.record.attempt) == (2, 1)
    assert_b_ran_only_after_a(a, b)
    assert slot.in_flight() == 0


def test_slot_holder_whose_worker_keeps_dying_is_dead_then_the_queued_run_starts(
    worker_env: dict[str, str], workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    slot = Slot(tmp_path)
    # Prefork: A's step SIGKILLs the pool process running it, every time; the
    # worker's main process (and its beat, which runs the sweeper) survives.
    workers.append(start_worker(worker_env, tmp_path, "mortal", beat=True, pool="prefork"))
    a = slot.start("A", die=True)
    wait_for(lambda: "A:start" in slot.lines(), timeout=60, what="run A to start on the worker")
    b = slot.start("B")
    assert b.status == RunStatus.QUEUED
    slot.release.touch()

    with pytest.raises(RunFailedError):
        a.result(timeout=90)
    assert a.status == RunStatus.DEAD
    assert a.error["type"] == "durable.dead"
    assert a.record.attempt == MAX_ATTEMPTS + 1  # the claim past MAX_ATTEMPTS gave up without running it
    assert b.result(timeout=60) == {"held": "B"}

    assert slot.lines() == ["A:start"] * MAX_ATTEMPTS + ["B:start", "B:end"]
    assert b.record.attempt == 1
    assert_b_ran_only_after_a(a, b)
    assert slot.in_flight() == 0
