"""A real Celery worker is SIGKILLed inside a step holding the only slot of a step-level quota.

When the run is taken over (the sweeper sees it orphaned, a second worker claims
it), its replay frees the dead execution's slot once: the first waiting step runs,
the second still waits, and the taken-over run asks again behind them.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from durable import RunHandle, RunStatus, engine
from durable.models import StepSlot
from durable.testing import wait_for
from tests.processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


class Key:
    """Runs of ``test.step_slot`` on one fresh step key (limit 1), logging to one file."""

    def __init__(self, tmp_path: Path) -> None:
        self.key = f"provider:{uuid.uuid4().hex[:8]}"
        self.log = tmp_path / "calls.log"
        self.release = tmp_path / "release"

    def start(self, name: str) -> RunHandle:
        input = {"key": self.key, "name": name, "log": str(self.log), "release": str(self.release)}
        return engine.start("test.step_slot", input, run_id=f"{self.key}:{name}")

    def lines(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def slots(self) -> list[tuple[str, str]]:
        rows = StepSlot.objects.filter(key=self.key).order_by("id").values_list("run__run_id", "status")
        return [(run_id.rsplit(":", 1)[1], status) for run_id, status in rows]


def parked(handle: RunHandle, key: Key) -> bool:
    record = handle.refresh().record
    return record.status == RunStatus.SUSPENDED and record.waiting_for == f"slot:{key.key}"


def test_a_worker_killed_inside_a_limited_step_frees_its_slot_once_on_takeover(worker_processes: WorkerProcesses) -> None:
    key = Key(worker_processes.tmp_path)
    first = worker_processes.start("first", pool="threads", concurrency=4)
    a = key.start("A")
    wait_for(lambda: "A:start" in key.lines(), timeout=60, what="A's step to hold the slot on the first worker")
    b = key.start("B")
    wait_for(lambda: parked(b, key), timeout=30, what="B to wait for the slot")
    c = key.start("C")
    wait_for(lambda: parked(c, key), timeout=30, what="C to wait for the slot")
    assert key.slots() == [("A", "held"), ("B", "waiting"), ("C", "waiting")]

    worker_processes.kill(first)  # the worker dies inside A's step: nothing gives the slot back
    assert a.refresh().status == RunStatus.RUNNING

    worker_processes.start("second", beat=True, pool="threads", concurrency=4)
    # The takeover freed A's slot and handed it to B (only B: the limit is 1), then A asked again behind C.
    wait_for(lambda: "B:start" in key.lines(), timeout=90, what="B's step to run after A's takeover")
    wait_for(lambda: parked(a, key), timeout=30, what="A to wait again behind the others")
    assert parked(c, key)
    assert key.slots() == [("B", "held"), ("C", "waiting"), ("A", "waiting")]
    assert key.lines() == ["A:start", "B:start"]

    key.release.touch()
    for handle, name in ((a, "A"), (b, "B"), (c, "C")):
        assert handle.result(timeout=60) == {"held": name}
    assert key.lines() == ["A:start", "B:start", "B:end", "C:start", "C:end", "A:start", "A:end"]
    assert key.slots() == []
