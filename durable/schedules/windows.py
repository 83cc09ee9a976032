"""The windows of a schedule and their deterministic run ids.

Each firing starts the run of one *window* under the run id
``schedule:<name>:<window>``, so a window fired twice (a beat double-fire, a
redelivered message) starts one run.
"""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime, timedelta
from typing import Any

from croniter import croniter

from durable import models

#: Prefix of the run ids of a schedule's runs: ``schedule:<name>:<window>``.
RUN_ID_PREFIX = "schedule:"


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
        return latest_tick(schedule.cron, zoneinfo.ZoneInfo(schedule.timezone), now)
    seconds = int(schedule.interval_seconds or 1)
    return datetime.fromtimestamp(int(now.timestamp()) // seconds * seconds, UTC)


#: More than any daylight-saving shift (2 hours at most): how far wall-clock order
#: and time order can disagree near a change of the clocks.
_DST_MARGIN = timedelta(hours=3)


def latest_tick(cron: str, tz: Any, now: datetime) -> datetime:
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
