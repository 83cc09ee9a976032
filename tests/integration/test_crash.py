"""A real Celery worker process is SIGKILLed in the middle of a step."""

from __future__ import annotations

import pytest

from durable import DEFAULT_CONCURRENCY_STATUSES, RunStatus, engine
from durable.testing import wait_for
from tests.processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_sigkilled_worker_run_resumes_on_a_new_worker(worker_processes: WorkerProcesses) -> None:
    log, release = worker_processes.tmp_path / "calls.log", worker_processes.tmp_path / "release"
    lines = lambda: log.read_text().split() if log.exists() else []  # noqa: E731

    first = worker_processes.start("first")
    handle = engine.start("test.crashy", {"key": "crash", "log": str(log), "release": str(release)})
    wait_for(lambda: "slow-start" in lines(), timeout=60, what="the slow step to start on the first worker")
    assert handle.refresh().status == RunStatus.RUNNING

    worker_processes.kill(first)  # the worker dies in the middle of step "slow"
    assert handle.refresh().status == RunStatus.RUNNING  # nobody knows yet
    assert engine.count_runs(tag="concurrency:crash", statuses=DEFAULT_CONCURRENCY_STATUSES) == 1

    release.touch()
    worker_processes.start("second", beat=True)  # its beat runs the sweeper
    output = handle.result(timeout=90)

    assert output == {"steps": ["prepared", "slow-done"]}
    assert lines() == ["prepare", "slow-start", "slow-start"]  # "prepare" was not run again
    assert handle.record.attempt == 2
    assert engine.count_runs(tag="concurrency:crash", statuses=DEFAULT_CONCURRENCY_STATUSES) == 0
    assert engine.start("test.crashy", {"key": "crash", "log": str(log), "release": str(release)}).created


def test_a_terminated_database_connection_does_not_fail_the_run(worker_processes: WorkerProcesses) -> None:
    """The worker's connections are killed (``pg_terminate_backend``, as in a fast
    restart) while a step runs: the run completes and each step ran exactly once."""
    from tests.concurrency.test_connection_loss import terminate_other_backends

    log, release = worker_processes.tmp_path / "calls.log", worker_processes.tmp_path / "release"
    lines = lambda: log.read_text().split() if log.exists() else []  # noqa: E731

    worker_processes.start("only")
    handle = engine.start("test.crashy", {"key": "blip", "log": str(log), "release": str(release)})
    wait_for(lambda: "slow-start" in lines(), timeout=60, what="the slow step to start")
    assert terminate_other_backends() >= 1  # the worker's connection and its heartbeat's

    release.touch()
    output = handle.result(timeout=90)

    assert output == {"steps": ["prepared", "slow-done"]}
    assert lines() == ["prepare", "slow-start"]  # every finished step ran exactly once
    assert handle.record.error is None
