"""Persisted schedules: start a workflow with its input on a cron expression or every N seconds.

Behind each ``Schedule`` is a ``PeriodicTask`` row that makes beat (with
django-celery-beat's ``DatabaseScheduler``) send ``durable.fire_schedule`` with
the schedule's id. The functions here create, change, disable and delete those
rows together with the schedule, in one transaction: nothing else in durable
(the admin, the API) writes them.

Each firing starts the run of one *window* under a deterministic run id,
``schedule:<name>:<window>``, so a window fired twice (a beat double-fire, a
redelivered message) starts one run. A schedule with a ``concurrency_key`` takes
a quota of its own (it replaces the workflow's quota for its runs); a window the
quota refuses is skipped and written to ``last_error``, which the next
successful start clears.

The modules: ``service`` (create, update, pause, resume, delete), ``firing``
(``fire``, ``run_now``), ``windows`` (windows and run ids), ``validation`` and
``beat`` (the only importer of django_celery_beat). Import this package and use
the names below: ``from durable import schedules; schedules.create_schedule(...)``.
"""

from __future__ import annotations

from durable.schedules.beat import FIRE_SCHEDULE_TASK, PERIODIC_TASK_PREFIX, periodic_task_name
from durable.schedules.firing import Firing, Outcome, engine_for, fire, run_now
from durable.schedules.service import (
    UNSET,
    create_schedule,
    delete_schedule,
    describe,
    get_schedule,
    pause,
    resume,
    save_instance,
    update_schedule,
    when,
)
from durable.schedules.validation import FIELDS, MAX_INT, MAX_NAME_LENGTH, min_interval, validate
from durable.schedules.windows import RUN_ID_PREFIX, manual_run_id, window_of, window_run_id

__all__ = [
    "FIELDS",
    "FIRE_SCHEDULE_TASK",
    "MAX_INT",
    "MAX_NAME_LENGTH",
    "PERIODIC_TASK_PREFIX",
    "RUN_ID_PREFIX",
    "UNSET",
    "Firing",
    "Outcome",
    "create_schedule",
    "delete_schedule",
    "describe",
    "engine_for",
    "fire",
    "get_schedule",
    "manual_run_id",
    "min_interval",
    "pause",
    "periodic_task_name",
    "resume",
    "run_now",
    "save_instance",
    "update_schedule",
    "validate",
    "when",
    "window_of",
    "window_run_id",
]
