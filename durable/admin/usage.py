"""How full each concurrency key is, for the quota dashboard's "fullest first" order
and its filters (full, has queued, strategy), without computing every key.

A key is only in use while it has runs in flight, and those runs are few next to
the keys ever used (100,000 of them) or the finished runs: ``in_flight()`` reads
the in-flight runs through the runs' partial index on the unfinished statuses
and their concurrency tags, one grouped query whose cost grows with the runs in
flight, not with the number of keys. Every other key is idle (nothing in
flight): those follow, in key order, a page at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from django.db import connections, router
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Value
from django.db.models.expressions import RawSQL
from django.db.models.functions import Concat

import durable
from durable import exceptions, models
from durable.concurrency import TAG_PREFIX
from durable.status import ACTIVE_STATUSES, DEFAULT_CONCURRENCY_STATUSES, RunStatus


@dataclass
class InFlight:
    """A key's runs in flight: how many in each unfinished status, and which
    workflow versions they belong to."""

    by_status: dict[str, int] = field(default_factory=dict)
    workflows: set[tuple[str, str]] = field(default_factory=set)

    def active(self, count_statuses: Sequence[str] | None) -> int:
        """The runs occupying a slot (the unfinished ones among ``count_statuses``)."""
        return sum(self.by_status.get(s, 0) for s in (count_statuses or DEFAULT_CONCURRENCY_STATUSES))

    @property
    def queued(self) -> int:
        return self.by_status.get(RunStatus.QUEUED, 0)


def in_flight() -> dict[str, InFlight]:
    """Every key with runs in flight -> its ``InFlight``: one grouped query.

    Terminal statuses that a key counts (a lifetime cap counting ``completed``)
    are not read here, so such a key sorts by its in-flight runs only; its
    ``active`` column is exact all the same (``durable.quotas.infos_for``).
    """
    rows = (
        models.RunTag.objects.filter(run__status__in=ACTIVE_STATUSES, status__in=ACTIVE_STATUSES, tag__startswith=TAG_PREFIX)
        .values("tag", "status", "run__workflow", "run__version")
        .annotate(n=Count("id"))
        .order_by()
    )
    found: dict[str, InFlight] = {}
    for row in rows:
        entry = found.setdefault(row["tag"][len(TAG_PREFIX) :], InFlight())
        entry.by_status[row["status"]] = entry.by_status.get(row["status"], 0) + row["n"]
        entry.workflows.add((row["run__workflow"], row["run__version"]))
    return found


def is_full(lock: models.ConcurrencyLock, entry: InFlight | None) -> bool:
    """Whether the key has no free slot (its limit in effect reached: an operator's
    override, else the last known limit; a limit of 0 is always full)."""
    limit = lock.effective_limit
    if limit is None:
        return False
    return (entry.active(lock.count_statuses) if entry else 0) >= limit


def use_order(lock: models.ConcurrencyLock, entry: InFlight) -> tuple[bool, float, int, int]:
    """Sort key, largest = fullest: full first, then by share of the limit in use,
    then by runs in flight and queued."""
    active = entry.active(lock.count_statuses)
    limit = lock.effective_limit
    if limit is None:
        ratio = 0.0
    elif limit <= 0:
        ratio = 1.0
    else:
        ratio = active / limit
    return (is_full(lock, entry), ratio, active, entry.queued)


def strategies_of(entry: InFlight) -> set[str]:
    """The strategies the workflows of a key's runs in flight declare (registered in this process)."""
    registry = durable.engine.registry
    found: set[str] = set()
    for workflow, version in entry.workflows:
        try:
            definition = registry.get(workflow, version)
        except exceptions.UnknownWorkflowError:
            continue
        found.update(str(spec.strategy) for spec in definition.concurrency)
    return found


def idle(queryset: QuerySet[models.ConcurrencyLock]) -> QuerySet[models.ConcurrencyLock]:
    """The keys of ``queryset`` with no run in flight, in key order.

    One ``NOT EXISTS`` probe of the ``(tag, status)`` index per key read: a page
    (after an offset) reads that many keys, whatever the number of others.
    """
    busy = models.RunTag.objects.filter(tag=Concat(Value(TAG_PREFIX), OuterRef("key")), status__in=ACTIVE_STATUSES)
    return queryset.filter(~Exists(busy)).order_by("key")


def locks_of(queryset: QuerySet[models.ConcurrencyLock], keys: Iterable[str]) -> list[models.ConcurrencyLock]:
    """The lock rows of ``keys`` in ``queryset`` (its filters and search applied), in chunks."""
    keys = list(keys)
    found: list[models.ConcurrencyLock] = []
    for start in range(0, len(keys), 500):
        found.extend(queryset.filter(key__in=keys[start : start + 500]).order_by())
    return found


def keys_where(usage: Mapping[str, InFlight], test: str) -> Q:
    """A filter on the lock rows: ``full`` (no free slot), ``queued`` (runs waiting), or a strategy value."""
    if test == "queued":
        return _key_among([k for k, e in usage.items() if e.queued])
    if test == "full":
        # An idle key is full only with a limit of 0 or less (it refuses every start).
        candidates = locks_of(models.ConcurrencyLock.objects.only("key", "limit", "limit_override", "count_statuses"), usage)
        full = [lock.key for lock in candidates if is_full(lock, usage[lock.key])]
        return _key_among(full) | Q(limit_override__lte=0) | Q(limit_override__isnull=True, limit__lte=0)
    return _key_among([k for k, e in usage.items() if test in strategies_of(e)])


def _key_among(keys: list[str]) -> Q:
    """``key IN (keys)`` with the keys in one parameter: there may be more keys in flight
    than a statement takes parameters (65,535 when Django binds them on PostgreSQL's
    server, ``OPTIONS["server_side_binding"]``), and one parameter keeps the statement short."""
    vendor = connections[router.db_for_read(models.ConcurrencyLock)].vendor
    if vendor == "postgresql":
        return Q(key__in=RawSQL("SELECT unnest(%s::text[])", (keys,)))
    if vendor == "sqlite":
        return Q(key__in=RawSQL("SELECT value FROM json_each(%s)", (json.dumps(keys),)))
    return Q(key__in=keys)
