"""A real Celery worker dies while its run holds the only slot of a GROUP_ROUND_ROBIN key.

The run queued behind it must wait until the dead run is recovered and finishes,
or is given up as ``dead``, and then start at once.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from durable import DEFAULT_CONCURRENCY_STATUSES, RunHandle, RunStatus, engine
from durable.exceptions import RunFailedError
from durable.testing import wait_for
from tests.processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

MAX_ATTEMPTS = 2


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


def test_killed_slot_holder_recovers_then_the_queued_run_starts(worker_processes: WorkerProcesses) -> None:
    slot = Slot(worker_processes.tmp_path)
    first = worker_processes.start("first")
    a = slot.start("A")
    wait_for(lambda: "A:start" in slot.lines(), timeout=60, what="run A to hold the slot on the first worker")
    b = slot.start("B")
    assert b.status == RunStatus.QUEUED  # the key is full: B waits, holding no slot

    worker_processes.kill(first)  # the worker dies in A's step, A still holds the slot
    assert a.refresh().status == RunStatus.RUNNING
    assert b.refresh().status == RunStatus.QUEUED
    assert slot.in_flight() == 1

    slot.release.touch()
    worker_processes.start("second", beat=True)
    assert a.result(timeout=90) == {"held": "A"}  # the sweeper saw A orphaned, the second worker resumed it
    assert b.result(timeout=60) == {"held": "B"}  # A's release handed its slot to B

    assert slot.lines() == ["A:start", "A:start", "A:end", "B:start", "B:end"]
    assert (a.record.attempt, b.record.attempt) == (2, 1)
    assert_b_ran_only_after_a(a, b)
    assert slot.in_flight() == 0


def test_slot_holder_whose_worker_keeps_dying_is_dead_then_the_queued_run_starts(
    worker_processes: WorkerProcesses,
) -> None:
    slot = Slot(worker_processes.tmp_path)
    # Prefork: A's step SIGKILLs the pool process running it, every time; the
    # worker's main process (and its beat, which runs the sweeper) survives.
    worker_processes.start("mortal", beat=True, pool="prefork", env={"DURABLE_MAX_ATTEMPTS": str(MAX_ATTEMPTS)})
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
