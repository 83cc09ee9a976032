"""Persisted schedules: the only module that writes django-celery-beat's rows.

A ``Schedule`` starts its workflow with its input on a cron expression or every
N seconds. Behind each one is a ``PeriodicTask`` row that makes beat (with
django-celery-beat's ``DatabaseScheduler``) send ``durable.fire_schedule`` with
the schedule's id; this module creates, changes, disables and deletes those rows
together with the schedule, in one transaction. Nothing else in durable (the
admin, the API) writes them.

Each firing starts the run of one *window* under a deterministic run id,
``schedule:<name>:<window>``, so a window fired twice (a beat double-fire, a
redelivered message) starts one run. A schedule with a ``concurrency_key`` takes
a quota of its own (it replaces the workflow's quota for its runs); a window the
quota refuses is skipped and written to ``last_error``, which the next
successful start clears.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import re
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from typing import Any, Literal

from celery import schedules as celery_schedules
from croniter import CroniterError, croniter
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import JSONField, Value
from django.utils import timezone as django_timezone
from django_celery_beat import models as beat

import durable
from durable import concurrency, exceptions, models, tasks
from durable.conf import settings
from durable.runtime.core import Engine, RunHandle
from durable.runtime.registry import Definition, Registry
from durable.status import RunStatus
from durable.util import check_json

logger = logging.getLogger(__name__)

#: Name of the ``PeriodicTask`` row of a schedule: this prefix and the schedule's name.
PERIODIC_TASK_PREFIX = "durable-schedule:"
#: Longest schedule name: its ``PeriodicTask`` name must fit 200 characters.
MAX_NAME_LENGTH = 200 - len(PERIODIC_TASK_PREFIX)
#: Prefix of the run ids of a schedule's runs: ``schedule:<name>:<window>``.
RUN_ID_PREFIX = "schedule:"
#: Largest interval, limit and other integer a schedule stores (a 32-bit column).
MAX_INT = 2**31 - 1

#: Letters, digits, "_", "." and "-": a name is part of run ids and URLs, and
#: without ":" or "/" it cannot make two run ids or two URLs look alike.
_NAME = re.compile(r"[\w.-]+")
_CRON_HINT = (
    "Use five fields: minute hour day-of-month month day-of-week, "
    "for example '0 9 * * 1-5' (09:00 on weekdays) or '*/15 * * * *'."
)
#: The fields a schedule's settings are validated and saved as (model field names).
FIELDS = (
    "name",
    "workflow",
    "input",
    "cron",
    "interval_seconds",
    "timezone",
    "namespace",
    "concurrency_key",
    "concurrency_limit",
    "enabled",
)


class _Unset(enum.Enum):
    UNSET = enum.auto()

    def __repr__(self) -> str:
        return "UNSET"


#: "Leave this setting as it is" in ``update_schedule``.
UNSET: Literal[_Unset.UNSET] = _Unset.UNSET


class Outcome(str, enum.Enum):
    """What one firing of a schedule did."""

    #: A new run was created (pending, or queued under a round-robin quota).
    STARTED = "started"
    #: The window's run exists already (a repeated fire): nothing was started.
    ALREADY_STARTED = "already_started"
    #: The quota refused the window: nothing was started; see ``last_error``.
    SKIPPED = "skipped"
    #: The start failed for another reason (unknown workflow, bad input); see ``last_error``.
    FAILED = "failed"
    #: The schedule is paused: nothing was started (beat fired before it saw the pause).
    PAUSED = "paused"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Firing:
    """The result of ``fire`` or ``run_now``."""

    schedule: str
    #: The window (UTC): a cron tick, the start of an interval, or the time of a manual run.
    window: datetime
    run_id: str
    outcome: Outcome
    #: The run, when one was started or existed already.
    handle: RunHandle | None = None
    #: What was written to ``last_error`` (skipped or failed), else "".
    error: str = ""

    @property
    def started(self) -> bool:
        return self.outcome is Outcome.STARTED


# -- validation -------------------------------------------------------------------


def validate(values: dict[str, Any], *, registry: Registry | None = None) -> dict[str, Any]:
    """Check a schedule's settings (a dict of ``FIELDS``) and return them cleaned.

    Raises ``InvalidScheduleError`` whose ``errors`` maps each bad field to
    messages that say how to fix it. Writes nothing.
    """
    errors: dict[str, list[str]] = {}

    def error(field: str, message: str) -> None:
        errors.setdefault(field, []).append(message)

    cleaned = dict(values)
    registry = registry or durable.engine.registry

    name = values.get("name")
    if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name):
        error(
            "name",
            f"A schedule name must be 1 to {MAX_NAME_LENGTH} letters, digits, '_', '.' or '-' "
            f"(it becomes part of run ids and URLs), got {name!r}.",
        )

    definition: Definition | None = None
    workflow = values.get("workflow")
    if not isinstance(workflow, str) or not workflow:
        error("workflow", f"Give the name of a registered workflow, got {workflow!r}.")
    else:
        try:
            definition = registry.current(workflow)
        except exceptions.UnknownWorkflowError as exc:
            error("workflow", str(exc))

    input_ok = True
    try:
        cleaned["input"] = check_json(values.get("input"), what="the schedule's input")
    except exceptions.InvalidStartError as exc:
        input_ok = False
        error("input", str(exc))

    cron = values.get("cron") or ""
    interval = values.get("interval_seconds")
    if not isinstance(cron, str):
        error("cron", f"A cron expression must be a string. {_CRON_HINT}")
        cron = ""
    cron = " ".join(cron.split())
    cleaned["cron"] = cron
    if cron and interval is not None:
        for field in ("cron", "interval_seconds"):
            error(field, "Give either a cron expression or an interval in seconds (every), not both.")
    elif not cron and interval is None:
        for field in ("cron", "interval_seconds"):
            error(field, "Give a cron expression or an interval in seconds (every): the schedule needs one of them.")
    elif cron:
        problem = _cron_problem(cron)
        if problem:
            error("cron", problem)
    elif isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= MAX_INT:
        error(
            "interval_seconds",
            f"The interval (every) must be a whole number of seconds from 1 to {MAX_INT}, got {interval!r}.",
        )
    elif interval < min_interval():
        error(
            "interval_seconds",
            f"The interval (every) must be at least {min_interval()} seconds (SCHEDULE_MIN_INTERVAL), "
            f"got {interval}: a schedule may not fire more often.",
        )

    tz = values.get("timezone")
    if not isinstance(tz, str) or tz not in _timezones():
        error("timezone", f"Unknown timezone {tz!r}: use an IANA name such as 'UTC' or 'Europe/Paris'.")

    namespace = values.get("namespace")
    max_namespace = models.Schedule._meta.get_field("namespace").max_length or 100
    if not isinstance(namespace, str) or not 0 < len(namespace) <= max_namespace or "\x00" in namespace:
        error("namespace", f"A namespace must be a string of 1 to {max_namespace} characters, got {namespace!r}.")

    key = values.get("concurrency_key") or ""
    limit = values.get("concurrency_limit")
    cleaned["concurrency_key"] = key
    if not isinstance(key, str) or len(key) > concurrency.MAX_KEY_LENGTH or "\x00" in key:
        error(
            "concurrency_key",
            f"A concurrency key must be a string of at most {concurrency.MAX_KEY_LENGTH} characters, got {key!r}.",
        )
        key = "?"  # the key/limit pairing below still applies
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        error("concurrency_limit", f"The schedule's concurrency limit must be an integer, got {limit!r}.")
    elif limit is not None and not 0 <= limit <= MAX_INT:
        error(
            "concurrency_limit",
            f"The schedule's concurrency limit must be from 0 to {MAX_INT} (0 skips every window), got {limit!r}.",
        )
    if key and limit is None:
        error(
            "concurrency_limit",
            f"The concurrency key {key!r} needs a limit: how many runs of the key may be in flight "
            "when a window starts.",
        )
    if not key and limit is not None:
        error(
            "concurrency_key",
            "A concurrency limit needs a concurrency key (the quota bucket it limits); "
            "leave both empty to use the workflow's own quota.",
        )

    enabled = values.get("enabled")
    if not isinstance(enabled, bool):
        error("enabled", f"enabled must be true or false, got {enabled!r}.")

    if definition is not None and input_ok and not key and limit is None and definition.concurrency:
        # Without a quota of its own, each window starts under the workflow's
        # quota: its key must be computable from this input.
        try:
            concurrency.resolve(definition.concurrency, cleaned["input"])
        except exceptions.InvalidStartError as exc:
            error("input", f"The workflow's own quota cannot be computed from this input: {exc}")

    if errors:
        raise exceptions.InvalidScheduleError(errors)
    return cleaned


def clean_instance(schedule: models.Schedule) -> None:
    """``Schedule.clean()``: ``validate`` as a Django ``ValidationError`` (for model forms)."""
    try:
        cleaned = validate({field: getattr(schedule, field) for field in FIELDS})
    except exceptions.InvalidScheduleError as exc:
        raise ValidationError(exc.errors) from exc
    for field in ("cron", "input"):
        setattr(schedule, field, cleaned[field])


def _cron_problem(cron: str) -> str | None:
    fields = cron.split()
    if len(fields) != 5:
        return f"Invalid cron expression {cron!r}: it has {len(fields)} fields, not 5. {_CRON_HINT}"
    if not croniter.is_valid(cron):
        return f"Invalid cron expression {cron!r}. {_CRON_HINT}"
    try:
        _beat_crontab(cron)
    except (ValueError, TypeError, IndexError) as exc:
        # croniter accepts extensions (L, #, 7 for Sunday) that beat's crontab does not.
        return f"Invalid cron expression {cron!r}: {exc} {_CRON_HINT}"
    try:
        _latest_tick(cron, UTC, django_timezone.now())
    except CroniterError:
        return f"Invalid cron expression {cron!r}: it never fires. {_CRON_HINT}"
    shortest = _shortest_gap(cron, min_interval())
    if shortest is not None:
        return (
            f"The cron expression {cron!r} fires {_minutes(shortest)} after a previous firing: a schedule may "
            f"not fire more often than every {min_interval()} seconds (SCHEDULE_MIN_INTERVAL)."
        )
    return None


def min_interval() -> int:
    """The ``SCHEDULE_MIN_INTERVAL`` setting: the shortest time between two firings, in seconds (at least 1)."""
    return max(1, math.ceil(settings.SCHEDULE_MIN_INTERVAL))


def _shortest_gap(cron: str, minimum: int) -> int | None:
    """The shortest time in minutes between two ticks of ``cron`` if it is below
    ``minimum`` seconds, else None. Measured on the wall clock (a DST change may
    shorten one gap by an hour): between two ticks of one day, and from a day's
    last tick to the first tick of the next day that fires."""
    crontab: Any = _beat_crontab(cron)  # its fields parsed into sets of numbers (untyped in celery's stubs)
    times = sorted(hour * 60 + minute for hour in crontab.hour for minute in crontab.minute)
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    if gaps and min(gaps) * 60 < minimum:
        return min(gaps)
    if (24 * 60 - times[-1] + times[0]) * 60 >= minimum:
        return None  # even two days in a row are far enough apart
    # The fewest days between two firing days: 28 years repeat the calendar
    # (weekdays and leap days), day-of-month AND day-of-week as beat reads them.
    days = [
        day
        for day in (date(2001, 1, 1) + timedelta(days=n) for n in range(28 * 365 + 7))
        if day.day in crontab.day_of_month
        and day.month in crontab.month_of_year
        and day.isoweekday() % 7 in crontab.day_of_week
    ]
    spans = [(later - earlier).days for earlier, later in zip(days, days[1:], strict=False)]
    if not spans:
        return None
    overnight = min(spans) * 24 * 60 - times[-1] + times[0]
    return overnight if overnight * 60 < minimum else None


def _minutes(minutes: int) -> str:
    for unit, size in (("day", 24 * 60), ("hour", 60)):
        if minutes % size == 0:
            count = minutes // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{minutes} minute{'s' if minutes != 1 else ''}"


def _beat_crontab(cron: str) -> celery_schedules.crontab:
    """The crontab beat fires on (raises ``ValueError`` for what it cannot parse)."""
    minute, hour, day_of_month, month_of_year, day_of_week = cron.split()
    return celery_schedules.crontab(
        minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month_of_year, day_of_week=day_of_week
    )


@lru_cache(maxsize=1)
def _timezones() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


# -- windows and run ids ------------------------------------------------------------


def window_of(schedule: models.Schedule, now: datetime) -> datetime:
    """The window ``now`` falls in (UTC).

    Cron: the latest tick of the expression at or before ``now``. The ticks are
    wall-clock times of the schedule's timezone, each one instant: a time that
    occurs twice (the clocks go back) is its first occurrence, and a time that
    does not exist (the clocks go forward) is shifted forward by the gap (02:30
    becomes 03:30 summer time), as Python reads a wall-clock time with
    ``fold=0``. Interval: ``now`` rounded down to a multiple of the interval,
    counted from the Unix epoch.
    """
    if schedule.cron:
        return _latest_tick(schedule.cron, zoneinfo.ZoneInfo(schedule.timezone), now)
    seconds = int(schedule.interval_seconds or 1)
    return datetime.fromtimestamp(int(now.timestamp()) // seconds * seconds, UTC)


#: More than any daylight-saving shift (2 hours at most): how far wall-clock order
#: and time order can disagree near a change of the clocks.
_DST_MARGIN = timedelta(hours=3)


def _latest_tick(cron: str, tz: Any, now: datetime) -> datetime:
    """The latest instant at or before ``now`` of a wall-clock tick of ``cron`` in ``tz`` (see ``window_of``)."""
    now = now.astimezone(UTC)
    # croniter walks naive wall-clock times (no DST arithmetic of its own). Its
    # get_prev is strictly before its start: start at the next minute so that a
    # tick equal to ``now`` (to the minute) is the window. day_or=False:
    # day-of-month AND day-of-week, as beat's crontab reads them.
    start = now.astimezone(tz).replace(tzinfo=None, second=0, microsecond=0) + timedelta(minutes=1)
    # Away from a change of the clocks, the first tick back is the latest. Near
    # one, a later wall-clock time may be an earlier instant (02:30 of a repeated
    # hour, 03:00 just after a skipped 02:45): look at every tick within the margin.
    margin = _DST_MARGIN if _clocks_change_near(tz, now) else timedelta(0)
    ticks = croniter(cron, start + margin, day_or=False)
    best: tuple[datetime, datetime] | None = None  # (instant, wall-clock time)
    while True:
        wall: datetime = ticks.get_prev(datetime)
        instant = wall.replace(tzinfo=tz).astimezone(UTC)  # fold=0: first occurrence, or shifted forward
        if instant <= now and (best is None or instant > best[0]):
            best = (instant, wall)
            if not margin and _clocks_change_near(tz, instant):
                margin = _DST_MARGIN
        if best is not None and wall <= best[1] - margin:
            return best[0]


def _clocks_change_near(tz: Any, instant: datetime) -> bool:
    """Whether ``tz``'s UTC offset changes within ``_DST_MARGIN`` of ``instant``."""
    return bool((instant - _DST_MARGIN).astimezone(tz).utcoffset() != (instant + _DST_MARGIN).astimezone(tz).utcoffset())


def window_run_id(name: str, window: datetime) -> str:
    """``schedule:<name>:<window, UTC, ISO 8601>``: the run id of one window."""
    return f"{RUN_ID_PREFIX}{name}:{window.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}"


def manual_run_id(name: str, at: datetime) -> str:
    """``schedule:<name>:manual:<time, UTC, ISO 8601 with microseconds>``: a "run now" run id."""
    return f"{RUN_ID_PREFIX}{name}:manual:{at.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%S.%fZ')}"


# -- firing -------------------------------------------------------------------------


def fire(schedule_id: int, *, now: datetime | None = None) -> Firing | None:
    """Start the run of the window ``now`` falls in (what beat's task calls).

    Idempotent per window: a repeated fire returns ``ALREADY_STARTED``. An
    over-limit window is skipped and written to ``last_error`` (``SKIPPED``).
    Returns None when the schedule no longer exists.
    """
    schedule = models.Schedule.objects.filter(pk=schedule_id).first()
    if schedule is None:
        logger.warning(
            "Schedule #%s no longer exists; beat fired it before it saw the deletion. Nothing was started.",
            schedule_id,
        )
        return None
    now = now or django_timezone.now()
    window = window_of(schedule, now)
    run_id = window_run_id(schedule.name, window)
    if not schedule.enabled:
        logger.info("Schedule %r is paused: window %s started nothing.", schedule.name, _stamp(window))
        return Firing(schedule.name, window, run_id, Outcome.PAUSED)
    return _start(schedule, window, run_id, now=now, label=f"Window {_stamp(window)}")


def run_now(schedule: models.Schedule | str, *, now: datetime | None = None) -> Firing:
    """Start a run of the schedule at once, outside its windows, under the schedule's quota.

    Its run id is ``schedule:<name>:manual:<time>``, never a window's. Works on a
    paused schedule too. A refusal by the quota is written to ``last_error`` like
    a skipped window.
    """
    row = _get(schedule)
    now = now or django_timezone.now()
    return _start(row, now, manual_run_id(row.name, now), now=now, label=f"Manual run at {_stamp(now)}")


def _start(schedule: models.Schedule, window: datetime, run_id: str, *, now: datetime, label: str) -> Firing:
    engine = engine_for(schedule)
    quota = None  # the workflow's own quota
    if schedule.concurrency_key:
        # The schedule's own quota (the model guarantees a limit with a key).
        quota = concurrency.Concurrency(key=schedule.concurrency_key, limit=int(schedule.concurrency_limit or 0))
    try:
        handle = engine.start(schedule.workflow, schedule.input, run_id=run_id, concurrency=quota)
    except exceptions.ConcurrencyLimitError as exc:
        full = f"concurrency key {exc.key!r} is full ({exc.active} of {exc.limit} runs in flight)"
        if isinstance(exc, exceptions.ConcurrencyQueueFullError):
            full = f"the queue of concurrency key {exc.key!r} is full ({exc.queued} runs wait, max_queued={exc.max_queued})"
        message = f"{label} skipped: {full}, so no run was started. The next window starts normally once a slot is free."
        _record_error(schedule, message, now)
        logger.warning("Schedule %r: %s", schedule.name, message)
        return Firing(schedule.name, window, run_id, Outcome.SKIPPED, error=message)
    except exceptions.DurableError as exc:
        # The workflow is no longer registered, its key function fails on the
        # input, or the run id belongs to another run.
        message = f"{label} failed: {exc}"
        _record_error(schedule, message, now)
        logger.error("Schedule %r: %s", schedule.name, message)
        return Firing(schedule.name, window, run_id, Outcome.FAILED, error=message)
    if not handle.created:
        logger.info("Schedule %r: %s already started run %s; nothing new was started.", schedule.name, label, run_id)
        return Firing(schedule.name, window, run_id, Outcome.ALREADY_STARTED, handle=handle)
    if handle.status == RunStatus.CANCELLED:
        # Strategy.CANCEL_NEWEST of the workflow's quota: the run was created cancelled.
        reason = (handle.error or {}).get("message", "") if isinstance(handle.error, dict) else ""
        message = f"{label} skipped: its run {run_id!r} was created cancelled (CANCEL_NEWEST). {reason}".strip()
        _record_error(schedule, message, now)
        logger.warning("Schedule %r: %s", schedule.name, message)
        return Firing(schedule.name, window, run_id, Outcome.SKIPPED, handle=handle, error=message)
    models.Schedule.objects.filter(pk=schedule.pk).update(
        last_run_at=now, last_run_id=run_id, last_error="", last_error_at=None
    )
    schedule.last_run_at, schedule.last_run_id, schedule.last_error, schedule.last_error_at = now, run_id, "", None
    logger.info("Schedule %r: %s started run %s.", schedule.name, label, run_id)
    return Firing(schedule.name, window, run_id, Outcome.STARTED, handle=handle)


def engine_for(schedule: models.Schedule) -> Engine:
    """The engine a schedule starts its runs with: the default engine's store,
    dispatcher and registry, in the schedule's namespace."""
    base = durable.engine
    return Engine(base.store, namespace=schedule.namespace, dispatch=base.dispatch, registry=base.registry)


def _record_error(schedule: models.Schedule, message: str, now: datetime) -> None:
    models.Schedule.objects.filter(pk=schedule.pk).update(last_error=message, last_error_at=now)
    schedule.last_error, schedule.last_error_at = message, now


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- writing schedules (and their beat rows) ----------------------------------------------


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
        _sync_periodic_task(schedule)
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
        row = _get(schedule, lock=True)
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
        _sync_periodic_task(row)
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
        row = _get(schedule, lock=True)
        if row.enabled != enabled:
            row.enabled = enabled
            row.save(update_fields=["enabled", "updated_at"])
        _sync_periodic_task(row)
    logger.info("%s schedule %r.", "Resumed" if enabled else "Paused", row.name)
    return row


def delete_schedule(schedule: models.Schedule | str) -> None:
    """Delete a schedule and its beat entry. The runs it started are kept."""
    with transaction.atomic():
        row = _get(schedule, lock=True)
        task_id = row.periodic_task_id
        row.delete()
        task = beat.PeriodicTask.objects.filter(pk=task_id).first() if task_id is not None else None
        if task is not None:
            task.delete()  # PeriodicTask.delete() tells beat (PeriodicTasks.changed)
    logger.info("Deleted schedule %r.", row.name)


def get_schedule(name: str) -> models.Schedule:
    """The schedule named ``name``; ``ScheduleNotFound`` if there is none."""
    return _get(name)


def _get(schedule: models.Schedule | str, *, lock: bool = False) -> models.Schedule:
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


def describe(schedule: models.Schedule) -> str:
    """``cron '0 9 * * *' Europe/Paris`` or ``every 60s``, with the schedule's own quota if any."""
    when = f"cron {schedule.cron!r} {schedule.timezone}" if schedule.cron else f"every {schedule.interval_seconds}s"
    if schedule.concurrency_key:
        when += f", own quota {schedule.concurrency_key} limit {schedule.concurrency_limit}"
    return when


# -- django-celery-beat rows --------------------------------------------------------


def periodic_task_name(name: str) -> str:
    return PERIODIC_TASK_PREFIX + name


def _sync_periodic_task(schedule: models.Schedule) -> beat.PeriodicTask:
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
    task.task = tasks.FIRE_SCHEDULE_TASK
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
