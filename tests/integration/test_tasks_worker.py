"""``DurableBackend`` tasks on real Celery workers: the in-process worker (SQLite and
memory broker, or PostgreSQL and Redis), and worker processes that consume one
queue or are SIGKILLed inside a task (PostgreSQL and Redis)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from durable import RunStatus, engine
from durable.contrib.tasks import framework as fw
from durable.testing import wait_for
from testproject.celery import app as celery_app
from tests import djtasks
from tests.processes import WorkerProcesses

Status = fw.TaskResultStatus
pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def _finished(result: Any, timeout: float = 30) -> Any:
    def done() -> bool:
        result.refresh()
        return bool(result.is_finished)

    wait_for(done, timeout=timeout, what=f"task run {result.id} to finish")
    return result


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_an_enqueued_task_runs_on_a_worker(celery_worker: Any) -> None:
    result = _finished(djtasks.add.enqueue(2, 3))

    assert (result.status, result.return_value) == (Status.SUCCESSFUL, 5)
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert len(result.worker_ids) == 1
    assert engine.get_run(result.id).status == RunStatus.COMPLETED


def test_an_async_task_through_aenqueue_and_aget_result(celery_worker: Any) -> None:
    async def flow() -> Any:
        result = await djtasks.async_add.aenqueue(40, 2)
        for _ in range(600):
            fetched = await djtasks.async_add.aget_result(result.id)
            if fetched.is_finished:
                return fetched
            await __import__("asyncio").sleep(0.05)
        raise AssertionError("the async task did not finish in 30 s")

    fetched = async_to_sync(flow)()
    assert (fetched.status, fetched.return_value) == (Status.SUCCESSFUL, 42)


def test_a_failing_task_fails_with_its_traceback(celery_worker: Any) -> None:
    result = _finished(djtasks.fail.enqueue("disk full"))

    assert result.status == Status.FAILED
    assert result.errors[0].exception_class is ValueError
    assert "disk full" in result.errors[0].traceback


def test_run_after_defers_the_task_and_its_timer_wakes_it(celery_worker: Any, tmp_path: Path) -> None:
    """No sweeper runs here (no beat): the run wakes by its timer message alone."""
    log = tmp_path / "calls.log"
    due = timezone.now() + timedelta(seconds=2)
    result = djtasks.log_call.using(run_after=due).enqueue(str(log), "ran")

    wait_for(lambda: engine.get_run(result.id).status == RunStatus.SUSPENDED, timeout=20, what="the run to park")
    assert djtasks.log_call.get_result(result.id).status == Status.READY
    assert _lines(log) == []  # not before run_after

    _finished(result)
    assert result.status == Status.SUCCESSFUL
    assert _lines(log) == ["ran"]
    assert result.started_at >= due


# -- worker processes (PostgreSQL and Redis) ----------------------------------------------------
def _pid(worker_id: str) -> int:
    """The process of a worker id as durable records it (``host:pid:thread``)."""
    return int(worker_id.split(":")[1])


def _purge(queue: str) -> None:
    with contextlib.suppress(Exception), celery_app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue)


@pytest.mark.postgres
def test_queue_name_routes_the_task_to_the_workers_of_that_queue(worker_processes: WorkerProcesses) -> None:
    _purge("emails")
    mail = worker_processes.start("mail", queues="emails")
    other = djtasks.add.enqueue(1, 2)  # the default queue: no worker consumes it yet
    result = _finished(djtasks.send_email.enqueue("ada@example.com"), timeout=60)

    assert (result.status, result.return_value) == (Status.SUCCESSFUL, "sent to ada@example.com")
    assert _pid(result.worker_ids[0]) == mail.pid  # the solo pool runs tasks in the worker's own process
    assert djtasks.add.get_result(other.id).status == Status.READY  # the emails worker never took it

    default = worker_processes.start("default")
    assert _finished(other, timeout=60).return_value == 3
    assert _pid(other.worker_ids[0]) == default.pid


@pytest.mark.postgres
def test_a_worker_sigkilled_inside_a_task_the_run_is_recovered(worker_processes: WorkerProcesses) -> None:
    log, release = worker_processes.tmp_path / "calls.log", worker_processes.tmp_path / "release"
    first = worker_processes.start("first")
    result = djtasks.slow.enqueue(str(log), str(release))
    wait_for(lambda: "slow-start" in _lines(log), timeout=60, what="the task to start on the first worker")
    assert djtasks.slow.get_result(result.id).status == Status.RUNNING

    worker_processes.kill(first)  # the worker dies inside the task
    release.touch()
    second = worker_processes.start("second", beat=True)  # its beat runs the sweeper, which re-sends the orphan

    _finished(result, timeout=90)
    assert (result.status, result.return_value) == (Status.SUCCESSFUL, "slow-done")
    assert _lines(log) == ["slow-start", "slow-start"]  # at least once: the killed attempt, then the recovery
    assert engine.get_run(result.id).record.attempt == 2
    assert _pid(result.worker_ids[0]) == second.pid
