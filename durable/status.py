"""Run statuses."""

from __future__ import annotations

from django.db import models


class RunStatus(models.TextChoices):
    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    SUSPENDED = "suspended"
    BLOCKED = "blocked"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD = "dead"


TERMINAL_STATUSES: frozenset[str] = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD})
#: The statuses ``Engine.retry`` starts again.
RETRYABLE_STATUSES: frozenset[str] = frozenset({RunStatus.FAILED, RunStatus.DEAD, RunStatus.CANCELLED})
ACTIVE_STATUSES: tuple[str, ...] = tuple(s.value for s in RunStatus if s not in TERMINAL_STATUSES)
ALL_STATUSES: frozenset[str] = frozenset(s.value for s in RunStatus)

#: The statuses that occupy a concurrency slot by default.
DEFAULT_CONCURRENCY_STATUSES: tuple[str, ...] = ("pending", "running", "suspended", "blocked")
