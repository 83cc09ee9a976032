"""Firing schedules: ``fire`` (what beat's task calls) and ``run_now``.

A firing starts the run of its window under the window's run id (see
``durable.schedules.windows``). A schedule with a ``concurrency_key`` takes a
quota of its own (it replaces the workflow's quota for its runs); a window the
quota refuses is skipped and written to ``last_error``, which the next
successful start clears.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import transaction
from django.utils import timezone as django_timezone

import durable
from durable import concurrency, exceptions, models, signals
from durable.runtime.engine import Engine, RunHandle
from durable.schedules import service
from durable.schedules.windows import manual_run_id, window_of, window_run_id
from durable.status import RunStatus

logger = logging.getLogger(__name__)


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
    row = service.load(schedule)
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
        _skipped(schedule, window, run_id, message, exc)
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
        # CANCEL_NEWEST (or CANCEL_QUEUED_EXCEPT_OLDEST on a full queue) of the workflow's
        # quota: the run was created cancelled; its error's type names the strategy.
        error = handle.error if isinstance(handle.error, dict) else {}
        reason = error.get("message", "")
        strategy = str(error.get("type") or "durable.cancel_newest").removeprefix("durable.").upper()
        message = f"{label} skipped: its run {run_id!r} was created cancelled ({strategy}). {reason}".strip()
        _record_error(schedule, message, now)
        logger.warning("Schedule %r: %s", schedule.name, message)
        _skipped(schedule, window, run_id, message, None)
        return Firing(schedule.name, window, run_id, Outcome.SKIPPED, handle=handle, error=message)
    models.Schedule.objects.filter(pk=schedule.pk).update(last_run_at=now, last_run_id=run_id, last_error="", last_error_at=None)
    schedule.last_run_at, schedule.last_run_id, schedule.last_error, schedule.last_error_at = now, run_id, "", None
    logger.info("Schedule %r: %s started run %s.", schedule.name, label, run_id)
    return Firing(schedule.name, window, run_id, Outcome.STARTED, handle=handle)


def engine_for(schedule: models.Schedule) -> Engine:
    """The engine a schedule starts its runs with: the default engine in the
    schedule's namespace (its store, dispatcher, registry and fencing)."""
    return durable.engine.in_namespace(schedule.namespace)


def _record_error(schedule: models.Schedule, message: str, now: datetime) -> None:
    models.Schedule.objects.filter(pk=schedule.pk).update(last_error=message, last_error_at=now)
    schedule.last_error, schedule.last_error_at = message, now


def _skipped(schedule: models.Schedule, window: datetime, run_id: str, reason: str, error: Exception | None) -> None:
    """Send ``window_skipped`` once ``last_error`` is committed."""
    if signals.window_skipped.has_listeners(models.Schedule):
        manual = run_id != window_run_id(schedule.name, window)
        signals.send_on_commit(
            transaction.on_commit,
            signals.window_skipped,
            models.Schedule,
            schedule=schedule,
            window=window,
            run_id=run_id,
            reason=reason,
            manual=manual,
            error=error,
        )


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
