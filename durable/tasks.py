"""Thin Celery tasks: they take a run id and call the engine.

Messages are JSON, acknowledged late and requeued when the worker process dies,
so a crash never loses a run; the engine's compare-and-set claim makes a
duplicate delivery change nothing.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from durable.conf import settings

EXECUTE_TASK = "durable.execute_run"
SWEEP_TASK = "durable.sweep"


@shared_task(name=EXECUTE_TASK, acks_late=True, reject_on_worker_lost=True, serializer="json", ignore_result=True)
def execute_run(run_id: str) -> None:
    from durable import engine

    engine.execute(run_id)


@shared_task(name=SWEEP_TASK, serializer="json", ignore_result=True)
def sweep() -> dict[str, list[str]]:
    from durable import engine

    return engine.sweep()


def task_id(run_id: str, generation: int) -> str:
    """The Celery task id of a run's messages: the same for every message of one generation."""
    return f"{run_id}:{generation}"


def send_run(run_id: str, *, task_id: str) -> None:
    """Send one run to the workers (called on commit)."""
    options: dict[str, Any] = {"serializer": "json", "task_id": task_id}
    if settings.TASK_QUEUE:
        options["queue"] = settings.TASK_QUEUE
    execute_run.apply_async(args=(run_id,), **options)


def revoke(task_id: str) -> None:
    """Ask the workers to drop the messages of a cancelled run they have not started.

    Best effort: a message that still arrives finds the run cancelled and does nothing.
    """
    execute_run.app.control.revoke(task_id)


def beat_schedule() -> dict[str, dict[str, Any]]:
    """The periodic sweep, to merge into ``app.conf.beat_schedule``::

        app.conf.beat_schedule = {**durable.tasks.beat_schedule(), ...}
    """
    entry: dict[str, Any] = {"task": SWEEP_TASK, "schedule": float(settings.SWEEP_INTERVAL)}
    if settings.TASK_QUEUE:
        entry["options"] = {"queue": settings.TASK_QUEUE}
    return {"durable-sweep": entry}
