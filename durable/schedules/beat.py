"""django-celery-beat's rows behind the schedules: the only module of durable that imports django_celery_beat.

Each schedule has one ``PeriodicTask`` row that makes beat (with
django-celery-beat's ``DatabaseScheduler``) send ``durable.fire_schedule`` with
the schedule's id. ``durable.schedules.service`` calls this module in the same
transaction as it writes the schedule; nothing else (the admin, the API) writes
these rows.
"""

from __future__ import annotations

import json
import zoneinfo

from django_celery_beat import models as beat

from durable import models
from durable.conf import settings

#: Name of the ``PeriodicTask`` row of a schedule: this prefix and the schedule's name.
PERIODIC_TASK_PREFIX = "durable-schedule:"
#: The task each row sends: the name of ``durable.tasks.fire_schedule`` (written
#: here, not imported from ``durable.tasks``, which imports this package).
FIRE_SCHEDULE_TASK = "durable.fire_schedule"


def periodic_task_name(name: str) -> str:
    return PERIODIC_TASK_PREFIX + name


def sync_periodic_task(schedule: models.Schedule) -> beat.PeriodicTask:
    """Make the schedule's ``PeriodicTask`` row say what the schedule says.

    ``PeriodicTask.save()`` bumps ``PeriodicTasks.last_update``, which is how
    beat's ``DatabaseScheduler`` notices the change.
    """
    task = None
    if schedule.periodic_task_id is not None:
        task = beat.PeriodicTask.objects.filter(pk=schedule.periodic_task_id).first()
    if task is None:
        name = periodic_task_name(schedule.name)
        task = beat.PeriodicTask.objects.filter(name=name).first() or beat.PeriodicTask(name=name)
    if schedule.cron:
        task.crontab, task.interval = _crontab_row(schedule.cron, schedule.timezone), None
    else:
        task.crontab, task.interval = None, _interval_row(int(schedule.interval_seconds or 1))
    task.solar = task.clocked = None
    task.one_off = False
    task.task = FIRE_SCHEDULE_TASK
    task.args = json.dumps([schedule.pk])
    task.kwargs = "{}"
    task.queue = settings.TASK_QUEUE or None
    task.enabled = schedule.enabled
    task.description = (
        f"Fires durable schedule {schedule.name!r}. Managed by durable.schedules: "
        "change the schedule (admin, API or durable.schedules), not this row."
    )
    task.save()
    if schedule.periodic_task_id != task.pk:
        models.Schedule.objects.filter(pk=schedule.pk).update(periodic_task=task)
        schedule.periodic_task = task
    return task


def delete_periodic_task(task_id: int | None) -> None:
    """Delete a schedule's ``PeriodicTask`` row, if it still exists."""
    task = beat.PeriodicTask.objects.filter(pk=task_id).first() if task_id is not None else None
    if task is not None:
        task.delete()  # PeriodicTask.delete() tells beat (PeriodicTasks.changed)


def _crontab_row(cron: str, tz: str) -> beat.CrontabSchedule:
    minute, hour, day_of_month, month_of_year, day_of_week = cron.split()
    fields = {
        "minute": minute,
        "hour": hour,
        "day_of_month": day_of_month,
        "month_of_year": month_of_year,
        "day_of_week": day_of_week,
        "timezone": zoneinfo.ZoneInfo(tz),
    }
    # Rows are shared with other periodic tasks: reuse one, never change or delete it.
    return beat.CrontabSchedule.objects.filter(**fields).first() or beat.CrontabSchedule.objects.create(**fields)


def _interval_row(seconds: int) -> beat.IntervalSchedule:
    fields = {"every": seconds, "period": beat.IntervalSchedule.SECONDS}
    return beat.IntervalSchedule.objects.filter(**fields).first() or beat.IntervalSchedule.objects.create(**fields)
