"""A pool's row records the statuses its pool counts (PostgreSQL, ``durable_admit``).

The second call of ``durable_admit`` (``"lock_pool": true``, after the first found
the pool busy) locks a pool that sorts between two keys of the start beside the
key after it. 0017 recorded that key's ``count_statuses`` on the pool's row: a
plain quota with narrower statuses then made ``durable_promote`` (which counts a
key with its row's statuses) hand slots of the pool to queued runs past its limit.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError

from durable import DEFAULT_CONCURRENCY_STATUSES, Burst, Concurrency, ConcurrencyLimitError, DjangoStore, Engine, Strategy
from durable.models import ConcurrencyLock
from durable.runtime import Registry

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

COUNTED = list(DEFAULT_CONCURRENCY_STATUSES)


class _LockNotAvailable(Exception):
    sqlstate = "55P03"


@pytest.fixture
def busy_pool(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every first call of durable_admit (the one taking the pool with NOWAIT) fails as
    it does when another transaction holds the pool's row (tests/concurrency/test_burst_locks.py
    does it for real): the start is made again with "lock_pool": true."""
    second_calls: list[bool] = []
    call = DjangoStore._call_admit

    def first_call_finds_the_pool_busy(self: DjangoStore, *args: Any, retry: bool, **kwargs: Any) -> Any:
        if retry:
            exc = OperationalError("could not obtain lock on row (a busy pool, simulated)")
            exc.__cause__ = _LockNotAvailable()
            raise exc
        second_calls.append(True)
        return call(self, *args, retry=retry, **kwargs)

    monkeypatch.setattr(DjangoStore, "_call_admit", first_call_finds_the_pool_busy)
    return second_calls


@pytest.fixture
def engine(settings: Any) -> Engine:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {"u-pool": 2}}
    registry = Registry()
    # "tenant:x" < "u-pool" < "z-key": the second call locks the pool beside z-key.
    registry.register(
        "w",
        "1",
        lambda ctx, input: None,
        [
            Concurrency(key="tenant:x", limit=1, burst=Burst(pool="u-pool", up_to=5)),
            Concurrency(key="z-key", limit=100, count_statuses=["running"]),
        ],
    )
    registry.register("p", "1", lambda ctx, input: None, Concurrency(key="u-pool", limit=2, strategy=Strategy.GROUP_ROUND_ROBIN))
    return Engine(DjangoStore(), dispatch=lambda engine, run: None, registry=registry)


def pool_statuses() -> list[str]:
    return ConcurrencyLock.objects.get(key="u-pool").count_statuses


def test_the_second_call_records_the_pools_statuses_on_its_row(engine: Engine, busy_pool: list[bool]) -> None:
    engine.start("w", {})  # guaranteed
    borrowed = engine.start("w", {})
    assert busy_pool == [True, True]  # both made their second call
    assert sorted(borrowed.record.tags) == [
        "borrowed:tenant:x",
        "concurrency:tenant:x",
        "concurrency:u-pool",
        "concurrency:z-key",
    ]
    assert pool_statuses() == COUNTED
    assert ConcurrencyLock.objects.get(key="z-key").count_statuses == ["running"]  # the key keeps its own


def test_a_hand_off_on_the_pool_never_overfills_it(engine: Engine, busy_pool: list[bool]) -> None:
    assert [engine.start("p", {}).status for _ in range(3)] == ["pending", "pending", "queued"]  # the pool full, one queued
    engine.start("w", {})  # guaranteed: never reads the pool
    with pytest.raises(ConcurrencyLimitError) as refused:
        engine.start("w", {})  # would borrow: its second call locks the pool, and the full pool refuses it
    assert refused.value.source == "pool"
    engine.promoter.promote(["u-pool"])  # the next hand-off on the pool (a release, the sweeper)
    assert engine.count_runs(tag="concurrency:u-pool", statuses=["queued"]) == 1, "a queued run was handed a slot"
    assert engine.count_runs(tag="concurrency:u-pool", statuses=COUNTED) == 2  # the pool limit
    assert pool_statuses() == COUNTED
