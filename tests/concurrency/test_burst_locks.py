"""A start that borrows never waits for its pool's lock out of key order (PostgreSQL).

The pool ``aa-pool`` sorts before the tenant key, so ``durable_admit`` takes it with
NOWAIT after the tenant's; while another transaction holds the pool, that call
fails with lock_not_available and the start is made again with the pool locked
first. While it waits for the pool, it holds no lock of the tenant key: the lock
order of every waiter is key order (docs/explanation/burst.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError, connection, transaction

from durable import Burst, Concurrency, DjangoStore, Engine
from durable.runtime import Registry
from tests.concurrency.test_threads import wait_for_lock_waiters
from tests.threads import held_open, started

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def engine(settings: Any) -> Engine:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {"aa-pool": 3}}
    registry = Registry()
    quota = Concurrency(key="tenant:x", limit=1, burst=Burst(pool="aa-pool", up_to=3))
    registry.register("w", "1", lambda ctx, input: None, quota)
    return Engine(DjangoStore(), dispatch=lambda engine, run: None, registry=registry)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each call of durable_admit did: "ok" or the SQLSTATE it raised."""
    seen: list[str] = []
    call = DjangoStore._call_admit

    def spy(self: DjangoStore, *args: Any, **kwargs: Any) -> Any:
        try:
            row = call(self, *args, **kwargs)
        except OperationalError as exc:
            seen.append(getattr(exc.__cause__, "sqlstate", "?"))
            raise
        seen.append("ok")
        return row

    monkeypatch.setattr(DjangoStore, "_call_admit", spy)
    return seen


def lock(key: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM durable_concurrencylock WHERE key = %s FOR UPDATE NOWAIT", [key])


@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "in-a-transaction"])
def test_a_busy_pool_is_waited_for_in_key_order_holding_nothing(engine: Engine, calls: list[str], atomic: bool) -> None:
    engine.start("w", {}), engine.start("w", {})  # the guarantee, then a borrowed run (the pool's row exists)
    calls.clear()

    def borrow() -> list[str]:
        if atomic:
            with transaction.atomic():
                handle = engine.start("w", {})
                with connection.cursor() as cursor:  # the transaction is still usable after the retry
                    cursor.execute("SELECT 1")
        else:
            handle = engine.start("w", {})
        return sorted(handle.record.tags)

    with held_open(lambda: lock("aa-pool")):
        borrower = started(borrow)
        wait_for_lock_waiters(1)
        # It waits for the pool, holding no lock of the tenant key: another transaction takes it at once.
        with transaction.atomic():
            lock("tenant:x")
        assert calls == ["55P03"]
    assert borrower.outcome() == ["borrowed:tenant:x", "concurrency:aa-pool", "concurrency:tenant:x"]
    assert calls == ["55P03", "ok"]
    assert engine.count_runs(tag="concurrency:aa-pool", statuses=["pending"]) == 2


def test_a_free_pool_is_taken_in_one_call(engine: Engine, calls: list[str]) -> None:
    engine.start("w", {}), engine.start("w", {})
    calls.clear()
    assert "borrowed:tenant:x" in engine.start("w", {}).record.tags
    assert calls == ["ok"]
