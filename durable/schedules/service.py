"""Creating, changing, pausing, resuming and deleting schedules, each together
with its beat row (``durable.schedules.beat``) in one transaction."""

from __future__ import annotations

import enum
import logging
from typing import Any, Literal

from django.db import IntegrityError, transaction
from django.db.models import JSONField, Value

import durable
from durable import exceptions, models
from durable.schedules import beat
from durable.schedules.validation import FIELDS, validate

logger = logging.getLogger(__name__)


class _Unset(enum.Enum):
    UNSET = enum.auto()

    def __repr__(self) -> str:
        return "UNSET"


#: "Leave this setting as it is" in ``update_schedule``.
UNSET: Literal[_Unset.UNSET] = _Unset.UNSET


def create_schedule(
    name: str,
    workflow: str,
    input: Any,
    *,
    cron: str | None = None,
    every: int | None = None,
    timezone: str = "UTC",
    namespace: str | None = None,
    concurrency_key: str = "",
    concurrency_limit: int | None = None,
    enabled: bool = True,
) -> models.Schedule:
    """Create a schedule and its beat entry; raise ``InvalidScheduleError`` (writing nothing) on bad settings.

    Exactly one of ``cron`` (five fields, read in ``timezone``) and ``every``
    (seconds) is given. ``namespace`` defaults to the ``NAMESPACE`` setting.
    ``concurrency_key``/``concurrency_limit`` give the schedule a quota of its
    own, used instead of the workflow's for its runs.
    """
    values = {
        "name": name,
        "workflow": workflow,
        "input": input,
        "cron": cron or "",
        "interval_seconds": every,
        "timezone": timezone,
        "namespace": durable.engine.namespace if namespace is None else namespace,
        "concurrency_key": concurrency_key,
        "concurrency_limit": concurrency_limit,
        "enabled": enabled,
    }
    cleaned = validate(values)
    # Names are global, across namespaces: the same words whoever holds the name,
    # so a tenant learns that it is taken and nothing about the holder.
    taken = exceptions.InvalidScheduleError({"name": [f"The schedule name {name!r} is taken: choose another name."]})
    with transaction.atomic():
        if models.Schedule.objects.filter(name=name).exists():
            raise taken
        try:
            with transaction.atomic():
                schedule = models.Schedule.objects.create(**_storable(cleaned))
        except IntegrityError as exc:
            if models.Schedule.objects.filter(name=name).exists():  # created concurrently
                raise taken from exc
            raise
        beat.sync_periodic_task(schedule)
    schedule.refresh_from_db()
    logger.info("Created schedule %r (%s).", schedule.name, describe(schedule))
    return schedule


def update_schedule(
    schedule: models.Schedule | str,
    *,
    workflow: str | Literal[_Unset.UNSET] = UNSET,
    input: Any = UNSET,
    cron: str | None | Literal[_Unset.UNSET] = UNSET,
    every: int | None | Literal[_Unset.UNSET] = UNSET,
    timezone: str | Literal[_Unset.UNSET] = UNSET,
    namespace: str | Literal[_Unset.UNSET] = UNSET,
    concurrency_key: str | Literal[_Unset.UNSET] = UNSET,
    concurrency_limit: int | None | Literal[_Unset.UNSET] = UNSET,
    enabled: bool | Literal[_Unset.UNSET] = UNSET,
) -> models.Schedule:
    """Change the given settings of a schedule (by instance or name) and its beat entry.

    A schedule keeps its name. Giving a ``cron`` replaces an interval and giving
    ``every`` replaces a cron expression. Raises ``InvalidScheduleError`` (changing
    nothing) on bad settings and ``ScheduleNotFound``.
    """
    with transaction.atomic():
        row = load(schedule, lock=True)
        values = {field: getattr(row, field) for field in FIELDS}
        given = {
            "workflow": workflow,
            "input": input,
            "timezone": timezone,
            "namespace": namespace,
            "concurrency_key": concurrency_key,
            "concurrency_limit": concurrency_limit,
            "enabled": enabled,
        }
        values.update({field: value for field, value in given.items() if value is not UNSET})
        if cron is not UNSET:
            values["cron"] = cron or ""
            if every is UNSET and cron:
                values["interval_seconds"] = None
        if every is not UNSET:
            values["interval_seconds"] = every
            if cron is UNSET and every is not None:
                values["cron"] = ""
        cleaned = validate(values)
        for field, value in _storable(cleaned).items():
            setattr(row, field, value)
        # Only the settings: a window fired meanwhile keeps its last_run_*/last_error.
        row.save(update_fields=[*FIELDS, "updated_at"])
        row.input = cleaned["input"]
        beat.sync_periodic_task(row)
    logger.info("Updated schedule %r (%s).", row.name, describe(row))
    return row


def _storable(cleaned: dict[str, Any]) -> dict[str, Any]:
    """The values to write: an input of ``None`` is stored as JSON ``null`` (the
    column is not nullable, and a bare ``None`` would be SQL ``NULL``)."""
    if cleaned["input"] is None:
        return {**cleaned, "input": Value(None, JSONField())}
    return cleaned


def save_instance(schedule: models.Schedule) -> models.Schedule:
    """Create (no primary key yet) or update the schedule from an instance's settings.

    For model forms such as the admin's: the instance's ``FIELDS`` are what is
    saved, through ``create_schedule``/``update_schedule``. Returns the saved row.
    """
    settings: dict[str, Any] = {
        "workflow": schedule.workflow,
        "input": schedule.input,
        "cron": schedule.cron,
        "every": schedule.interval_seconds,
        "timezone": schedule.timezone,
        "namespace": schedule.namespace,
        "concurrency_key": schedule.concurrency_key,
        "concurrency_limit": schedule.concurrency_limit,
        "enabled": schedule.enabled,
    }
    if schedule.pk is None:
        return create_schedule(schedule.name, **settings)
    return update_schedule(schedule, **settings)


def pause(schedule: models.Schedule | str) -> models.Schedule:
    """Disable a schedule (and its beat entry): its windows start nothing until ``resume``."""
    return _set_enabled(schedule, False)


def resume(schedule: models.Schedule | str) -> models.Schedule:
    """Enable a schedule again. Windows missed while it was paused are not caught up."""
    return _set_enabled(schedule, True)


def _set_enabled(schedule: models.Schedule | str, enabled: bool) -> models.Schedule:
    with transaction.atomic():
        row = load(schedule, lock=True)
        if row.enabled != enabled:
            row.enabled = enabled
            row.save(update_fields=["enabled", "updated_at"])
        beat.sync_periodic_task(row)
    logger.info("%s schedule %r.", "Resumed" if enabled else "Paused", row.name)
    return row


def delete_schedule(schedule: models.Schedule | str) -> None:
    """Delete a schedule and its beat entry. The runs it started are kept."""
    with transaction.atomic():
        row = load(schedule, lock=True)
        task_id = row.periodic_task_id
        row.delete()
        beat.delete_periodic_task(task_id)
    logger.info("Deleted schedule %r.", row.name)


def get_schedule(name: str) -> models.Schedule:
    """The schedule named ``name``; ``ScheduleNotFound`` if there is none."""
    return load(name)


def load(schedule: models.Schedule | str, *, lock: bool = False) -> models.Schedule:
    """The schedule (by instance or name), re-read (``lock``: ``SELECT ... FOR UPDATE``); ``ScheduleNotFound`` if gone."""
    qs = models.Schedule.objects.select_for_update() if lock else models.Schedule.objects.all()
    if isinstance(schedule, models.Schedule):
        found = qs.filter(pk=schedule.pk).first()
        name = schedule.name
    else:
        name = schedule
        found = qs.filter(name=name).first() if isinstance(name, str) and "\x00" not in name else None
    if found is None:
        raise exceptions.ScheduleNotFound(f"No schedule is named {name!r}.", name=name)
    return found


def when(schedule: models.Schedule) -> str:
    """``cron 0 9 * * *`` or ``every 60s``: when the schedule fires (the admin's "when" column)."""
    return f"cron {schedule.cron}" if schedule.cron else f"every {schedule.interval_seconds}s"


def describe(schedule: models.Schedule) -> str:
    """``cron 0 9 * * * Europe/Paris`` or ``every 60s``, with the schedule's own quota if any."""
    text = when(schedule)
    if schedule.cron:
        text += f" {schedule.timezone}"
    if schedule.concurrency_key:
        text += f", own quota {schedule.concurrency_key} limit {schedule.concurrency_limit}"
    return text
