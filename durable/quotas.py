"""Read-only view of the concurrency quotas, for the admin and the HTTP API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Exists, Min, OuterRef, Q, QuerySet, Value
from django.db.models.functions import Concat

from durable import conf, models
from durable.concurrency import BORROWED_PREFIX, TAG_PREFIX
from durable.status import ACTIVE_STATUSES, DEFAULT_CONCURRENCY_STATUSES, RunStatus


@dataclass(frozen=True)
class QuotaInfo:
    key: str
    #: The limit in effect: the operator's override if set, else the code's last known limit.
    limit: int | None
    count_statuses: tuple[str, ...]
    active: int
    queued: int
    oldest_active_at: datetime | None
    #: Creation time of the oldest run waiting in the key's queue (its age is now minus this).
    oldest_queued_at: datetime | None = None
    #: The limit the last start brought from the code, and the operator's override (None: none).
    code_limit: int | None = None
    limit_override: int | None = None
    #: A key with a burst (``Concurrency(burst=Burst(...))``, as its last start declared
    #: it): how many of ``active`` are borrowed from ``pool`` (the others are guaranteed,
    #: at most ``limit``), ``up_to``, and the pool's limit in effect and runs in flight.
    borrowed: int = 0
    pool: str | None = None
    up_to: int | None = None
    pool_limit: int | None = None
    pool_active: int | None = None
    #: The key is a pool of ``DURABLE["POOLS"]``: ``active`` counts the runs borrowing from
    #: it and those whose own quota it is.
    is_pool: bool = False

    @property
    def guaranteed(self) -> int:
        """The runs of ``active`` admitted within the key's limit (not borrowed)."""
        return self.active - self.borrowed


def visible_locks(namespace: str | None = None) -> QuerySet[models.ConcurrencyLock]:
    """The keys' lock rows, by key; with ``namespace``, only the keys it has used.

    "Used" is one ``EXISTS`` per key on the ``(tag, status, namespace)`` index, so
    a page of keys reads those keys' tag rows only.
    """
    locks = models.ConcurrencyLock.objects.order_by("key")
    if namespace is None:
        return locks
    used = models.RunTag.objects.filter(tag=Concat(Value(TAG_PREFIX), OuterRef("key")), namespace=namespace)
    return locks.filter(Exists(used))


def quota_infos(*, namespace: str | None = None, key: str | None = None) -> list[QuotaInfo]:
    """Every known key (or just ``key``) with its in-flight and queued counts.

    With ``namespace``, only that namespace's runs are counted and only keys it
    has used are listed. A list of keys one page at a time: ``infos_for()``.
    """
    locks = visible_locks(namespace)
    if key is not None:
        locks = locks.filter(key=key)
    return infos_for(list(locks), namespace=namespace)


def infos_for(lock_rows: Sequence[models.ConcurrencyLock], *, namespace: str | None = None) -> list[QuotaInfo]:
    """The ``QuotaInfo`` of each of ``lock_rows`` (a page of keys), in their order.

    One grouped query whatever the number of rows, reading the tag rows of these
    keys only: its cost does not grow with the number of other keys.
    """
    if not lock_rows:
        return []
    # A page's keys with a burst: their borrowed runs, and their pools (which need not be on the page).
    bursts = {lock.key: lock.burst for lock in lock_rows if isinstance(lock.burst, dict) and lock.burst.get("pool")}
    pool_keys = sorted({str(burst["pool"]) for burst in bursts.values()})
    counted_tags = [TAG_PREFIX + lock.key for lock in lock_rows]
    counted_tags += [BORROWED_PREFIX + key for key in bursts] + [TAG_PREFIX + pool for pool in pool_keys]
    # Every in-flight status, plus the terminal ones a key counts (a lifetime cap
    # counts "completed"): each an index range on (tag, status), so the finished
    # runs of the other keys are never read.
    wanted = Q(status__in=ACTIVE_STATUSES)
    for lock in lock_rows:
        terminal = sorted(set(lock.count_statuses or ()) - set(ACTIVE_STATUSES))
        if terminal:
            wanted |= Q(tag=TAG_PREFIX + lock.key, status__in=terminal)
    tags = models.RunTag.objects.filter(wanted, tag__in=counted_tags)
    if namespace is not None:
        tags = tags.filter(namespace=namespace)
    # One grouped query for every key: (tag, status) -> count, oldest creation.
    groups: dict[str, dict[str, tuple[int, datetime]]] = {}
    for row in tags.values("tag", "status").annotate(n=Count("id"), oldest=Min("run__created_at")):
        groups.setdefault(row["tag"], {})[row["status"]] = (row["n"], row["oldest"])
    pool_limits = _pool_limits(pool_keys)
    declared = conf.settings.POOLS or {}
    infos = []
    for lock in lock_rows:
        statuses = tuple(lock.count_statuses or DEFAULT_CONCURRENCY_STATUSES)
        by_status = groups.get(TAG_PREFIX + lock.key, {})
        counted = [by_status[s] for s in statuses if s in by_status]
        burst = bursts.get(lock.key) or {}
        pool = burst.get("pool")
        infos.append(
            QuotaInfo(
                key=lock.key,
                limit=lock.effective_limit,
                count_statuses=statuses,
                active=sum(n for n, _ in counted),
                queued=by_status.get(RunStatus.QUEUED, (0, None))[0],
                oldest_active_at=min((oldest for _, oldest in counted), default=None),
                oldest_queued_at=by_status.get(RunStatus.QUEUED, (0, None))[1],
                code_limit=lock.limit,
                limit_override=lock.limit_override,
                borrowed=_count(groups, BORROWED_PREFIX + lock.key, statuses) if pool else 0,
                pool=pool,
                up_to=burst.get("up_to"),
                pool_limit=pool_limits.get(pool) if pool else None,
                pool_active=_count(groups, TAG_PREFIX + pool, DEFAULT_CONCURRENCY_STATUSES) if pool else None,
                is_pool=isinstance(declared, dict) and lock.key in declared,
            )
        )
    return infos


def _count(groups: dict[str, dict[str, tuple[int, datetime]]], tag: str, statuses: Sequence[str]) -> int:
    by_status = groups.get(tag, {})
    return sum(by_status[s][0] for s in statuses if s in by_status)


def _pool_limits(pools: Sequence[str]) -> dict[str, int | None]:
    """Each pool's limit in effect: its row's (an operator's override, else the last
    one a start recorded), else ``DURABLE["POOLS"]``'s."""
    declared = conf.settings.POOLS or {}
    limits: dict[str, int | None] = {p: declared.get(p) if isinstance(declared, dict) else None for p in pools}
    for lock in models.ConcurrencyLock.objects.filter(key__in=list(pools)):
        if lock.effective_limit is not None:
            limits[lock.key] = lock.effective_limit
    return limits
