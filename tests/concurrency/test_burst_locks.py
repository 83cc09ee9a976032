"""A start that borrows never waits for its pool's lock out of key order (PostgreSQL).

The pool ``aa-pool`` sorts before the tenant key, so ``durable_admit`` takes it with
NOWAIT after the tenant's; while another transaction holds the pool, that call
fails with lock_not_available and the start is made again with the pool locked
first. While it waits for the pool, it holds no lock of the tenant key: the lock
order of every waiter is key order (docs/explanation/burst.md). Inside the
caller's transaction (which may hold the tenant key from an earlier start) the
pool is never waited for: a busy pool is tried a few times, then ``PoolBusyError``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction

from durable import Burst, Concurrency, DjangoStore, Engine, Strategy
from durable.exceptions import PoolBusyError
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
    pool = Concurrency(key="aa-pool", limit=3, strategy=Strategy.GROUP_ROUND_ROBIN)
    registry.register("p", "1", lambda ctx, input: None, pool)
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


def held_something() -> None:
    """The current transaction did something before (it has a transaction id), as an
    earlier start or any write of the caller would."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_xact_id()")


@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "in-a-transaction-holding-nothing"])
def test_a_busy_pool_is_waited_for_in_key_order_holding_nothing(engine: Engine, calls: list[str], atomic: bool) -> None:
    engine.start("w", {}), engine.start("w", {})  # the guarantee, then a borrowed run (the pool's row exists)
    calls.clear()

    def borrow() -> list[str]:
        if atomic:  # a transaction that held no lock before: the retry holds nothing either
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


def test_inside_a_transaction_a_busy_pool_is_never_waited_for(engine: Engine, calls: list[str]) -> None:
    engine.start("w", {}), engine.start("w", {})
    calls.clear()
    with held_open(lambda: lock("aa-pool")), transaction.atomic():
        held_something()  # else it would wait for the pool in key order, holding nothing
        with pytest.raises(PoolBusyError) as busy:
            engine.start("w", {})
        with connection.cursor() as cursor:  # the transaction is still usable
            cursor.execute("SELECT 1")
    assert calls == ["55P03"] * 4
    assert (busy.value.code, busy.value.pools, busy.value.attempts) == ("pool_busy", ["aa-pool"], 4)
    assert engine.count_runs(tag="concurrency:tenant:x", statuses=["pending"]) == 2  # nothing created
    assert "borrowed:tenant:x" in engine.start("w", {}).record.tags  # the pool free: it borrows


def test_inside_a_transaction_a_pool_freed_between_attempts_is_taken(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    engine.start("w", {}), engine.start("w", {})
    holding, release = threading.Event(), threading.Event()

    def hold_the_pool() -> None:
        with transaction.atomic():
            lock("aa-pool")
            holding.set()
            assert release.wait(30)

    holder = started(hold_the_pool)
    assert holding.wait(30)
    seen: list[str] = []
    call = DjangoStore._call_admit

    def free_the_pool_after_the_first_attempt(self: DjangoStore, *args: Any, **kwargs: Any) -> Any:
        try:
            row = call(self, *args, **kwargs)
        except OperationalError as exc:
            seen.append(getattr(exc.__cause__, "sqlstate", "?"))
            release.set()
            holder.outcome()  # the holder has committed before the next attempt
            raise
        seen.append("ok")
        return row

    monkeypatch.setattr(DjangoStore, "_call_admit", free_the_pool_after_the_first_attempt)
    with transaction.atomic():
        held_something()
        handle = engine.start("w", {})
    assert seen == ["55P03", "ok"]
    assert sorted(handle.record.tags) == ["borrowed:tenant:x", "concurrency:aa-pool", "concurrency:tenant:x"]


def wait_for_a_lock_waiter_in_a_transaction(timeout: float = 30) -> None:
    """As ``wait_for_lock_waiters(1)``, from inside a transaction (whose pg_stat_activity
    is a snapshot: cleared before each look)."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while True:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0] >= 1:
                return
            assert time.monotonic() < deadline, "the other transaction never waited for tenant:x"
            time.sleep(0.01)


def test_an_earlier_start_in_the_transaction_never_deadlocks_with_a_pool_holder(engine: Engine) -> None:
    # T1 starts tenant:x twice in one transaction: the first is guaranteed (T1 holds tenant:x
    # until it commits), the second would borrow from aa-pool, which T2 holds while it waits
    # for tenant:x. Rolling back the second start's savepoint does not release tenant:x, so
    # before the fix T1's second call waited for aa-pool holding tenant:x: a deadlock (40P01).
    first_done = threading.Event()

    def t1() -> str:
        with transaction.atomic():
            engine.start("w", {})  # guaranteed: holds tenant:x
            first_done.set()
            wait_for_a_lock_waiter_in_a_transaction()  # T2 holds aa-pool and waits for tenant:x
            try:
                engine.start("w", {})  # would borrow from aa-pool
            except PoolBusyError as exc:
                return exc.code
            return "admitted"

    with transaction.atomic():
        assert engine.start("p", {}).status == "pending"  # T2 holds aa-pool
        thread = started(t1)
        assert first_done.wait(30)
        second = engine.start("w", {})  # waits for tenant:x until T1 commits, then borrows
    assert thread.outcome() == "pool_busy"  # T1 gave up, without waiting for aa-pool
    assert sorted(second.record.tags) == ["borrowed:tenant:x", "concurrency:aa-pool", "concurrency:tenant:x"]
    assert engine.count_runs(tag="concurrency:tenant:x", statuses=["pending"]) == 2


def test_inside_a_transaction_the_first_borrow_creates_the_pools_row(engine: Engine, calls: list[str]) -> None:
    # Never waited for there, the pool's row is created by the call that first borrows from it
    # (0017 raised lock_not_available for a missing row, and its retry created it waiting).
    with transaction.atomic():
        engine.start("w", {})
        assert "borrowed:tenant:x" in engine.start("w", {}).record.tags
    assert calls == ["ok", "ok"]
    assert engine.count_runs(tag="concurrency:aa-pool", statuses=["pending"]) == 1
