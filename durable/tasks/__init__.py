"""durable's Celery side: the tasks a worker runs, the dispatcher of the default engine
and the background publisher of run messages. The only package of durable that
imports Celery; the engine (``durable.runtime``) knows it through the
``Dispatcher`` contract.

The modules: ``workers`` (the tasks, what a worker does as it comes up, the sweep's
beat entry), ``sending`` (``CeleryDispatcher`` and the sends after a commit),
``publishing`` (the background publisher, ``publisher``) and ``direct`` (the Redis
connection a starting thread writes its message on, the publisher reading the
replies). Importing this package registers the tasks (``app.autodiscover_tasks()``
does); use the names below. All of them log as ``durable.tasks``.
"""

from __future__ import annotations

from durable.tasks.publishing import SEND_RETRY_POLICY, Publisher, publisher
from durable.tasks.sending import CeleryDispatcher, live_queues, publish_run, revoke, send_run, send_wake, task_id
from durable.tasks.workers import (
    EXECUTE_TASK,
    FIRE_SCHEDULE_TASK,
    SWEEP_TASK,
    WAKE_TASK,
    beat_schedule,
    connection_advice,
    execute_run,
    fire_schedule,
    redelivery_delay,
    sweep,
    wake_run,
)

__all__ = [
    "EXECUTE_TASK",
    "FIRE_SCHEDULE_TASK",
    "SEND_RETRY_POLICY",
    "SWEEP_TASK",
    "WAKE_TASK",
    "CeleryDispatcher",
    "Publisher",
    "beat_schedule",
    "connection_advice",
    "execute_run",
    "fire_schedule",
    "live_queues",
    "publish_run",
    "publisher",
    "redelivery_delay",
    "revoke",
    "send_run",
    "send_wake",
    "sweep",
    "task_id",
    "wake_run",
]
