"""Burstable quotas: a key's runs beyond its ``limit`` borrow from a shared pool.

``Concurrency(key="tenant:acme", limit=8, burst=Burst(pool="global", up_to=20))``:
a start of the key is

- refused (``source="up_to"``) when the key has ``up_to`` runs in flight;
- admitted as *guaranteed* when fewer than ``limit`` of its runs in flight are
  guaranteed: it counts against the key only, whatever the pool holds;
- else admitted as *borrowed* when the pool has room: the run also carries the
  tags ``concurrency:<pool>`` (a slot of the pool, freed when the run finishes,
  as any key's) and ``borrowed:<key>`` (how the key tells its borrowed runs);
- else refused (``source="pool"``).

A run stays what it was admitted as until it finishes. So a key's guaranteed runs
never exceed ``limit``, its runs never exceed ``up_to``, its borrowed runs never
exceed ``up_to - limit``, and a key with fewer than ``limit`` runs in flight is
always admitted. This module is the generic path (``admission.decide`` calls
``decide`` under the locks of the key and of its pool); PostgreSQL's
``durable_admit`` decides the same in SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from durable import exceptions
from durable.concurrency import Quota
from durable.status import DEFAULT_CONCURRENCY_STATUSES


class Counter(Protocol):
    """What ``decide`` needs of an ``admission.Scope``."""

    def count(self, tag: str, statuses: Sequence[str]) -> int: ...

    def retry_after(self, quota: Quota) -> int: ...


def pool_quota(pool: str, limit: int) -> Quota:
    """A pool as a quota: its key, its limit, the statuses it counts (the default ones)."""
    return Quota(pool, limit, DEFAULT_CONCURRENCY_STATUSES)


def with_pools(quotas: Sequence[Quota]) -> list[Quota]:
    """``quotas`` and the pools their bursts borrow from (those not among them), for
    the generic path's ``store.admission``: every key and pool locked in key order,
    like any start's keys (so it never deadlocks with another start)."""
    keys = {q.key for q in quotas}
    pools = {q.burst.pool: q.burst.pool_limit for q in quotas if q.burst is not None and q.burst.pool not in keys}
    return [*quotas, *(pool_quota(pool, limit) for pool, limit in sorted(pools.items()))]


def in_effect(quotas: Sequence[Quota], locked: Sequence[Quota] | None) -> list[Quota]:
    """``quotas`` with the limits in effect that ``store.admission(with_pools(quotas))``
    read under the locks (None: the store has no overrides), a pool's override
    becoming its bursts' ``pool_limit``."""
    if locked is None:
        return list(quotas)
    limits = {q.key: q.limit for q in locked}
    return [_with_limits(q, limits) for q in quotas]


def with_overrides(quotas: Sequence[Quota], overrides: dict[str, int]) -> list[Quota]:
    """``quotas`` with the operators' ``overrides`` (by key, pools included) applied."""
    limits = {q.key: overrides.get(q.key, q.limit) for q in quotas}
    for q in quotas:
        if q.burst is not None and q.burst.pool in overrides:
            limits.setdefault(q.burst.pool, overrides[q.burst.pool])
    return [_with_limits(q, limits) for q in quotas]


def pools_of(quotas: Sequence[Quota]) -> list[str]:
    """The pools the bursts of ``quotas`` borrow from."""
    return sorted({q.burst.pool for q in quotas if q.burst is not None})


def _with_limits(quota: Quota, limits: dict[str, int]) -> Quota:
    quota = replace(quota, limit=limits.get(quota.key, quota.limit))
    if quota.burst is not None and quota.burst.pool in limits:
        quota = replace(quota, burst=replace(quota.burst, pool_limit=limits[quota.burst.pool]))
    return quota


def decide(scope: Counter, workflow: str, quota: Quota) -> list[str]:
    """Admit a start on ``quota`` (which has a burst; its key and pool are locked):
    the tags a borrowed run adds (none for a guaranteed one), or raise
    ``ConcurrencyLimitError`` with ``source`` "up_to" or "pool".

    The key's runs are counted before its borrowed ones: a borrowed run that
    finishes between the two counts then makes the guaranteed count look one
    higher, never lower, so a guaranteed admission never takes the key past its
    limit (and a key with fewer than ``limit`` runs in flight is admitted
    whatever the second count finds).
    """
    burst = quota.burst
    assert burst is not None
    ceiling = max(burst.up_to, quota.limit)
    total = scope.count(quota.tag, quota.count_statuses)
    borrowed = scope.count(quota.borrowed_tag, quota.count_statuses)
    if total < ceiling and total - borrowed < quota.limit:
        return []
    pool = pool_quota(burst.pool, burst.pool_limit)
    pool_active = scope.count(pool.tag, pool.count_statuses)
    if total < ceiling and pool_active < burst.pool_limit:
        return [burst.pool_tag, quota.borrowed_tag]
    at_ceiling = total >= ceiling
    raise exceptions.ConcurrencyLimitError(
        workflow=workflow,
        key=quota.key,
        limit=quota.limit,
        active=total,
        retry_after=scope.retry_after(quota if at_ceiling else pool),
        source="up_to" if at_ceiling else "pool",
        pool=burst.pool,
        pool_limit=burst.pool_limit,
        pool_active=pool_active,
        up_to=burst.up_to,
        borrowed=borrowed,
    )
