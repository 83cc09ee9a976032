"""A real Celery worker process is SIGKILLed in the middle of a step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from durable import DEFAULT_CONCURRENCY_STATUSES, RunStatus, engine
from durable.testing import wait_for
from testproject.celery import app as celery_app

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


QUEUE = "durable-crash-test"


@pytest.fixture
def worker_env(settings: Any) -> dict[str, str]:
    # A queue of its own: the session's in-process worker must not take these runs.
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": QUEUE}
    broker = celery_app.conf.broker_url
    if not broker.startswith("redis://"):
        pytest.skip("needs a Redis broker shared with a worker process: set CELERY_BROKER_URL")
    db = settings.DATABASES["default"]
    celery_app.control.purge()
    return {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "DURABLE_HEARTBEAT_INTERVAL": "0.2",
        "DURABLE_STALE_AFTER": "2",
        "DURABLE_SWEEP_INTERVAL": "0.5",
        "DURABLE_TASK_QUEUE": QUEUE,
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def workers(worker_env: dict[str, str], tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
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


def start_worker(env: dict[str, str], tmp_path: Path, name: str, *, beat: bool) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "celery", "-A", "testproject", "worker", "--pool=solo",
            "--loglevel=INFO", f"--hostname={name}@%h", "--without-gossip", "--without-mingle",
            "--include=tests.workflows", f"--queues={QUEUE}"]  # fmt: skip
    if beat:
        args += ["--beat", f"--schedule={tmp_path / 'beat-schedule'}"]
    log = open(tmp_path / f"{name}.log", "wb")
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_sigkilled_worker_run_resumes_on_a_new_worker(
    worker_env: dict[str, str], workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    log, release = tmp_path / "calls.log", tmp_path / "release"
    lines = lambda: log.read_text().split() if log.exists() else []  # noqa: E731

    workers.append(start_worker(worker_env, tmp_path, "first", beat=False))
    handle = engine.start("test.crashy", {"key": "crash", "log": str(log), "release": str(release)})
    wait_for(lambda: "slow-start" in lines(), timeout=60, what="the slow step to start on the first worker")
    assert handle.refresh().status == RunStatus.RUNNING

    os.killpg(workers[0].pid, signal.SIGKILL)  # the worker dies in the middle of step "slow"
    workers[0].wait(timeout=10)
    assert handle.refresh().status == RunStatus.RUNNING  # nobody knows yet
    assert engine.count_runs(tag="concurrency:crash", statuses=DEFAULT_CONCURRENCY_STATUSES) == 1

    release.touch()
    workers.append(start_worker(worker_env, tmp_path, "second", beat=True))
    output = handle.result(timeout=90)

    assert output == {"steps": ["prepared", "slow-done"]}
    assert lines() == ["prepare", "slow-start", "slow-start"]  # "prepare" was not run again
    assert handle.record.attempt == 2
    assert engine.count_runs(tag="concurrency:crash", statuses=DEFAULT_CONCURRENCY_STATUSES) == 0
    assert engine.start("test.crashy", {"key": "crash", "log": str(log), "release": str(release)}).created
