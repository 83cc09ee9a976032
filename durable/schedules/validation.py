"""Checking a schedule's settings: one set of rules and messages for the Python
functions, the HTTP API and the admin form. Writes nothing."""

from __future__ import annotations

import math
import re
import zoneinfo
from datetime import UTC, date, timedelta
from functools import lru_cache
from typing import Any

from celery import schedules as celery_schedules
from croniter import CroniterError, croniter
from django.utils import timezone as django_timezone

import durable
from durable import concurrency, exceptions, models
from durable.conf import settings
from durable.runtime.registry import Definition, Registry
from durable.schedules import beat, windows
from durable.util import check_json

#: Longest schedule name: its ``PeriodicTask`` name must fit 200 characters.
MAX_NAME_LENGTH = 200 - len(beat.PERIODIC_TASK_PREFIX)
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
            f"The concurrency key {key!r} needs a limit: how many runs of the key may be in flight when a window starts.",
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


def _cron_problem(cron: str) -> str | None:
    fields = cron.split()
    if len(fields) != 5:
        return f"Invalid cron expression {cron!r}: it has {len(fields)} fields, not 5. {_CRON_HINT}"
    if not croniter.is_valid(cron):
        return f"Invalid cron expression {cron!r}. {_CRON_HINT}"
    try:
        windows.latest_tick(cron, UTC, django_timezone.now())
    except CroniterError:
        # Before beat's own parse, whose message for it differs between Celery releases.
        return f"Invalid cron expression {cron!r}: it never fires. {_CRON_HINT}"
    try:
        _beat_crontab(cron)
    except (ValueError, TypeError, IndexError) as exc:
        # croniter accepts extensions (L, #, 7 for Sunday) that beat's crontab does not.
        return f"Invalid cron expression {cron!r}: {exc} {_CRON_HINT}"
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
        if day.day in crontab.day_of_month and day.month in crontab.month_of_year and day.isoweekday() % 7 in crontab.day_of_week
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
