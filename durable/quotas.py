"""Read-only view of the concurrency quotas, for the admin and the HTTP API."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Min, Q

from durable import models
from durable.concurrency import TAG_PREFIX
from durable.status import ACTIVE_STATUSES, DEFAULT_CONCURRENCY_STATUSES, RunStatus


@dataclass(frozen=True)
class QuotaInfo:
    key: str
    limit: int | None
    count_statuses: tuple[str, ...]
    active: int
    queued: int
    oldest_active_at: datetime | None
    #: Creation time of the oldest run waiting in the key's queue (its age is now minus this).
    oldest_queued_at: datetime | None = None


def quota_infos(*, namespace: str | None = None, key: str | None = None) -> list[QuotaInfo]:
    """Every known key (or just ``key``) with its in-flight and queued counts.

    With ``namespace``, only that namespace's runs are counted and only keys it
    has used are listed.
    """
    locks = models.ConcurrencyLock.objects.order_by("key")
    if key is not None:
        locks = locks.filter(key=key)
    lock_rows = list(locks)
    # Every in-flight status, plus the terminal ones a key counts (a lifetime cap
    # counts "completed"): each an index range on (tag, status), so the finished
    # runs of the other keys are never read.
    wanted = Q(status__in=ACTIVE_STATUSES)
    for lock in lock_rows:
        terminal = sorted(set(lock.count_statuses or ()) - set(ACTIVE_STATUSES))
        if terminal:
            wanted |= Q(tag=TAG_PREFIX + lock.key, status__in=terminal)
    tags = models.RunTag.objects.filter(wanted, tag__in=[TAG_PREFIX + lock.key for lock in lock_rows])
    if namespace is not None:
        tags = tags.filter(namespace=namespace)
    # One grouped query for every key: (tag, status) -> count, oldest creation.
    groups: dict[str, dict[str, tuple[int, datetime]]] = {}
    for row in tags.values("tag", "status").annotate(n=Count("id"), oldest=Min("run__created_at")):
        groups.setdefault(row["tag"][len(TAG_PREFIX) :], {})[row["status"]] = (row["n"], row["oldest"])
    if namespace is not None:
        used = set(
            models.RunTag.objects.filter(namespace=namespace, tag__in=[TAG_PREFIX + lock.key for lock in lock_rows])
            .values_list("tag", flat=True)
            .distinct()
        )
        lock_rows = [lock for lock in lock_rows if TAG_PREFIX + lock.key in used]
    infos = []
    for lock in lock_rows:
        statuses = tuple(lock.count_statuses or DEFAULT_CONCURRENCY_STATUSES)
        by_status = groups.get(lock.key, {})
        counted = [by_status[s] for s in statuses if s in by_status]
        infos.append(
            QuotaInfo(
                key=lock.key,
                limit=lock.limit,
                count_statuses=statuses,
                active=sum(n for n, _ in counted),
                queued=by_status.get(RunStatus.QUEUED, (0, None))[0],
                oldest_active_at=min((oldest for _, oldest in counted), default=None),
                oldest_queued_at=by_status.get(RunStatus.QUEUED, (0, None))[1],
            )
        )
    return infos
