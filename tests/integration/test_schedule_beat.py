"""A real Celery worker process with embedded beat (django-celery-beat's
DatabaseScheduler) fires a persisted schedule; its runs start and complete."""

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

from durable import models, schedules
from durable.status import RunStatus
from durable.testing import wait_for
from testproject.celery import app as celery_app

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def queue(settings: Any) -> str:
    """A Celery queue of this test only: the session's in-process worker must not
    take its messages, and the PeriodicTask row routes the fire task to it."""
    name = f"durable-beat-test-{uuid.uuid4().hex[:8]}"
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": name}
    return name


@pytest.fixture
def beat_worker(queue: str, settings: Any, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    broker = celery_app.conf.broker_url
    if not broker.startswith("redis://"):
        pytest.skip("needs a Redis broker shared with a worker process: set CELERY_BROKER_URL")
    db = settings.DATABASES["default"]
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "DURABLE_TASK_QUEUE": queue,
        "PYTHONPATH": str(ROOT),
    }
    args = [sys.executable, "-m", "celery", "-A", "testproject", "worker", "--pool=solo", "--loglevel=INFO",
            f"--hostname=beat-{queue}@%h", "--without-gossip", "--without-mingle", "--include=tests.workflows",
            f"--queues={queue}", "--beat", f"--schedule={tmp_path / 'beat-schedule'}"]  # fmt: skip
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(log_path.read_text(errors="replace")[-5000:])  # shown when the test fails


def test_beat_fires_an_interval_schedule_and_its_runs_complete(
    queue: str, beat_worker: subprocess.Popen[bytes]
) -> None:
    # Created after the worker started: beat picks it up from the database.
    schedule = schedules.create_schedule("beat-tick", "test.add", {"a": 2, "b": 3}, every=1)
    assert schedule.periodic_task is not None and schedule.periodic_task.queue == queue

    def completed() -> list[models.WorkflowRun]:
        assert beat_worker.poll() is None, "the worker process exited"
        return list(models.WorkflowRun.objects.filter(run_id__startswith="schedule:beat-tick:", status=RunStatus.COMPLETED))

    runs = wait_for(completed, timeout=90, interval=0.2, what="beat to start a run that completes")
    run = runs[0]
    assert run.output == {"total": 5}
    # The run id names its one-second window: schedule:beat-tick:<UTC second>Z.
    assert run.run_id.removeprefix("schedule:beat-tick:").endswith("Z")
    schedules.pause(schedule)  # beat stops firing it; nothing else to clean up
    ids = list(models.WorkflowRun.objects.filter(run_id__startswith="schedule:beat-tick:").values_list("run_id", flat=True))
    assert len(ids) == len(set(ids))
