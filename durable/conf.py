"""The one place that reads ``django.conf.settings`` for durable.

Every option lives in the ``DURABLE`` dictionary of the project's settings::

    DURABLE = {"STALE_AFTER": 60, "API_PERMISSION_CLASSES": [...]}

``durable.conf.settings.STALE_AFTER`` reads through to that dictionary on every
access, so ``override_settings(DURABLE=...)`` works in tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from django.conf import settings as django_settings


@dataclass(frozen=True)
class Defaults:
    #: Namespace of the default engine's runs.
    NAMESPACE: str = "default"
    #: Fence the default engine's reads (and quota counts) to its namespace.
    SCOPE_READS: bool = False
    #: Celery queue the run tasks are sent to (None: Celery's default queue).
    TASK_QUEUE: str | None = None
    #: Seconds between two heartbeats of a running run.
    HEARTBEAT_INTERVAL: float = 5.0
    #: A running run whose last heartbeat is older than this many seconds is
    #: considered orphaned (its worker died) and is taken over by the sweeper.
    STALE_AFTER: float = 30.0
    #: A pending run whose Celery message was sent this many seconds ago and
    #: that no worker picked up is sent again by the sweeper; each further
    #: re-send of the same run waits twice as long (at most 64 times this).
    REDISPATCH_AFTER: float = 60.0
    #: Publish the Celery message of a start from a background thread of the
    #: process (``durable.tasks.publisher``) instead of the caller's thread:
    #: the caller does not wait for the broker. False: send it on the caller's
    #: thread once the transaction commits.
    PUBLISH_IN_BACKGROUND: bool = True
    #: Shortest time in seconds between two batches of the background publisher:
    #: a message that comes sooner after the last batch waits for the rest of it
    #: and goes out with the messages that came meanwhile (one Redis pipeline);
    #: one that comes later goes at once. 0: each batch as soon as the thread
    #: gets to it. See ``publish_batch_interval``.
    PUBLISH_BATCH_INTERVAL: float = 0.005
    #: A Celery worker runs the lifecycle statements of the runs it executes (claim,
    #: journal writes, finish, hand-off) on a PostgreSQL connection each of its
    #: threads keeps across tasks, which Celery does not close around every task as
    #: it closes Django's. False: they use Django's connection, as the workflow's own
    #: queries do (a new connection per task unless ``CELERY_DB_REUSE_MAX`` is set).
    KEEP_WORKER_CONNECTION: bool = True
    #: Seconds between two sweeps (used by ``durable.tasks.beat_schedule()``).
    SWEEP_INTERVAL: float = 15.0
    #: How many times a run is started by a worker before it is marked ``dead``.
    MAX_ATTEMPTS: int = 5
    #: ``Retry-After`` seconds of a refusal when nothing is measured on its key yet
    #: (at least 1); see ``retry_after_seconds``.
    RETRY_AFTER: int = 1
    #: The longest ``Retry-After`` an estimate may give, in seconds.
    RETRY_AFTER_MAX: int = 60
    #: Permission classes of the HTTP API (dotted paths).
    API_PERMISSION_CLASSES: tuple[str, ...] = ("rest_framework.permissions.IsAuthenticated",)
    #: Dotted path of ``fn(request) -> str``: the namespace an API request is fenced
    #: to (its runs are created there, and it reads and counts only that namespace).
    #: None: no fencing, every authenticated user sees every run.
    API_NAMESPACE: str | None = None
    #: Page size of ``GET runs/``.
    API_PAGE_SIZE: int = 50
    #: Shortest time in seconds between two firings of a schedule: an interval
    #: (``every``) below it is refused, and so is a cron expression with two
    #: ticks closer than it. 60 is cron's own finest step (every minute).
    SCHEDULE_MIN_INTERVAL: int = 60
    #: Most characters of a traceback stored in a failed run's or step's ``error``
    #: (its end is kept: the frames nearest the raise). 0: no traceback is stored.
    TRACEBACK_LIMIT: int = 8192
    #: ``durable.contrib.prometheus``: how many concurrency keys the active-runs
    #: gauges export at most (in key order), read from the database at each
    #: scrape. 0: no such gauges.
    PROMETHEUS_ACTIVE_RUNS_KEYS: int = 0
    #: Delete finished runs once they are this old, on each sweep (a bounded batch):
    #: None (keep every run), one duration for every finished status ("30d"), or
    #: a dictionary by status ({"completed": "7d", "failed": "90d"}). See ``durable.retention``.
    RETENTION: str | Mapping[str, str | None] | None = None
    #: Shared pools that quotas may borrow from beyond their limit
    #: (``Concurrency(burst=Burst(pool=..., up_to=...))``): ``{pool name: limit}``.
    #: A pool is a concurrency key: at most ``limit`` runs in flight carry it.
    POOLS: Mapping[str, int] | None = None


class _Settings:
    def __getattr__(self, name: str) -> Any:
        if name not in _NAMES:
            raise AttributeError(f"durable has no setting {name!r}")
        user = getattr(django_settings, "DURABLE", {}) or {}
        if name in user:
            return user[name]
        return getattr(_DEFAULTS, name)


_DEFAULTS = Defaults()
_NAMES = frozenset(f.name for f in fields(Defaults))
settings = _Settings()


def setting_names() -> frozenset[str]:
    """The names durable's ``DURABLE`` dictionary may hold."""
    return _NAMES


def unknown_settings() -> list[str]:
    """Keys of ``settings.DURABLE`` that durable does not know (see checks)."""
    user = getattr(django_settings, "DURABLE", {}) or {}
    return sorted(set(user) - _NAMES)


def retry_after_seconds(estimate: float | None = None) -> int:
    """The ``Retry-After`` of a refusal, in whole seconds: ``estimate`` (the seconds
    until a slot of the full key should free, or None when nothing is measured)
    rounded up and clamped between 1 and ``RETRY_AFTER_MAX``; without an estimate
    ``RETRY_AFTER`` (at least 1). A misconfigured setting gives 1, never an error."""
    fallback = _whole_seconds(settings.RETRY_AFTER)
    if estimate is None or not math.isfinite(estimate):
        return fallback
    ceiling = max(1, _whole_seconds(settings.RETRY_AFTER_MAX))
    return min(ceiling, max(1, math.ceil(estimate)))


def _whole_seconds(value: Any) -> int:
    try:
        return max(1, math.ceil(float(value)))
    except (TypeError, ValueError, OverflowError):
        return 1


#: The longest ``PUBLISH_BATCH_INTERVAL`` (seconds) durable accepts.
MAX_PUBLISH_BATCH_INTERVAL = 1.0


def publish_batch_interval() -> float:
    """``PUBLISH_BATCH_INTERVAL`` as the publisher uses it: seconds between 0 and
    ``MAX_PUBLISH_BATCH_INTERVAL``. A misconfigured value (the system check
    durable.E005 reports it) gives the default, never an error in the publisher."""
    try:
        value = settings.PUBLISH_BATCH_INTERVAL
    except Exception:  # DURABLE itself is malformed: the thread must go on publishing
        return _DEFAULTS.PUBLISH_BATCH_INTERVAL
    if not valid_batch_interval(value):
        return _DEFAULTS.PUBLISH_BATCH_INTERVAL
    return float(value)


def valid_batch_interval(value: Any) -> bool:
    """Whether ``value`` is a ``PUBLISH_BATCH_INTERVAL`` durable accepts."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and 0 <= value <= MAX_PUBLISH_BATCH_INTERVAL
    )
