"""A real Celery worker process with embedded beat (django-celery-beat's
DatabaseScheduler) fires a persisted schedule; its runs start and complete."""

from __future__ import annotations

from typing import Any

import pytest

from durable import models, schedules
from durable.status import RunStatus
from durable.testing import wait_for
from tests.processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_beat_fires_an_interval_schedule_and_its_runs_complete(worker_processes: WorkerProcesses, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "SCHEDULE_MIN_INTERVAL": 1}  # one window a second, for a short test
    beat_worker = worker_processes.start("beat", beat=True)
    # Created after the worker started: beat picks it up from the database.
    schedule = schedules.create_schedule("beat-tick", "test.add", {"a": 2, "b": 3}, every=1)
    assert schedule.periodic_task is not None and schedule.periodic_task.queue == worker_processes.queue

    def completed() -> list[models.WorkflowRun]:
        assert beat_worker.poll() is None, f"the worker process exited: {worker_processes.log('beat')[-3000:]}"
        return list(models.WorkflowRun.objects.filter(run_id__startswith="schedule:beat-tick:", status=RunStatus.COMPLETED))

    runs = wait_for(completed, timeout=90, interval=0.2, what="beat to start a run that completes")
    run = runs[0]
    assert run.output == {"total": 5}
    # The run id names its one-second window: schedule:beat-tick:<UTC second>Z.
    assert run.run_id.removeprefix("schedule:beat-tick:").endswith("Z")
    schedules.pause(schedule)  # beat stops firing it; nothing else to clean up
    ids = list(models.WorkflowRun.objects.filter(run_id__startswith="schedule:beat-tick:").values_list("run_id", flat=True))
    assert len(ids) == len(set(ids))
