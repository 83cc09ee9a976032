"""Sleep, signals, children and remote queues on real Celery workers."""

from __future__ import annotations

from typing import Any

import pytest

from durable import RunStatus, engine
from durable.testing import wait_for
from tests.processes import WorkerProcesses
from tests.remote_service import REMOTE_QUEUE


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_child_and_signal_on_the_in_process_worker(celery_worker: Any) -> None:
    parent = engine.start("test.approval_parent", {"n": 7})
    wait_for(lambda: parent.refresh().record.waiting_for == "signal:decision", timeout=20, what="the signal wait")
    [child] = engine.list_runs(workflow="test.child_echo")
    assert child.status == RunStatus.COMPLETED and child.record.parent_run_id == parent.run_id
    parent.signal("decision", {"ok": True})
    assert parent.result(timeout=20) == {"child": {"echo": {"n": 7}}, "decision": {"ok": True}}


# -- worker subprocesses -----------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_sleep_survives_every_worker_restarting(worker_processes: WorkerProcesses) -> None:
    log = worker_processes.tmp_path / "calls.log"
    lines = lambda: log.read_text().split() if log.exists() else []  # noqa: E731
    first = worker_processes.start("first", include="tests.waiting")
    handle = engine.start("test.sleeper", {"log": str(log), "seconds": 3})
    wait_for(lambda: handle.refresh().status == RunStatus.SUSPENDED, timeout=30, what="the run to go to sleep")
    wake_at = handle.record.wake_at
    assert wake_at is not None and handle.record.waiting_for == "sleep"

    # The only worker dies while the run sleeps (its timer message dies with it).
    worker_processes.kill(first)
    worker_processes.start("second", include="tests.waiting", beat=True)

    assert handle.result(timeout=60) == "slept"
    assert lines() == ["before", "after"]
    assert handle.record.finished_at >= wake_at


@pytest.mark.postgres
@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_blocked_remote_run_resumes_when_a_worker_for_its_queue_starts(worker_processes: WorkerProcesses) -> None:
    engine.register_remote("test.remote_echo", "1", queue=REMOTE_QUEUE)
    try:
        handle = engine.start("test.remote_echo", {"x": 1})
        assert handle.record.queue == REMOTE_QUEUE
        swept = engine.sweep()  # asks the live workers: none consumes the remote queue
        assert handle.run_id in swept["blocked"]
        assert handle.refresh().status == RunStatus.BLOCKED

        # The other service starts a worker on its queue: the run goes by itself.
        worker_processes.start("remote", queues=REMOTE_QUEUE, include="tests.remote_service")
        assert handle.result(timeout=60) == {"served_by": "remote", "echo": {"x": 1}}
    finally:
        engine.registry.unregister("test.remote_echo")
