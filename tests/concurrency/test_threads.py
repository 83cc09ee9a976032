"""Threads with their own connections race on one key: exact on PostgreSQL and on SQLite."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from durable import Concurrency, ConcurrencyLimitError, Engine, InMemoryStore, Strategy
from durable.models import ConcurrencyLock
from durable.runtime import Registry
from durable.testing import wait_for
from tests.threads import held_open, started

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 8
STARTS_EACH = 15
LIMIT = 5


def test_threads_racing_on_a_brand_new_key_admit_exactly_the_limit() -> None:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None)
    engine = Engine(dispatch=lambda engine, run_id: None, registry=registry)
    key = f"threads:{uuid.uuid4().hex}"
    barrier = threading.Barrier(THREADS)
    admitted: list[str] = []
    refused: list[int] = []

    def starter() -> None:
        barrier.wait(timeout=30)
        for _ in range(STARTS_EACH):
            try:
                admitted.append(engine.start("w", {}, concurrency=Concurrency(key=key, limit=LIMIT)).run_id)
            except ConcurrencyLimitError as exc:
                refused.append(exc.active)

    for thread in [started(starter) for _ in range(THREADS)]:
        thread.outcome()
    assert len(admitted) == LIMIT, f"{len(admitted)} admitted with a limit of {LIMIT} on {connection.vendor}"
    assert len(refused) == THREADS * STARTS_EACH - LIMIT
    assert set(refused) == {LIMIT}  # every refusal saw exactly the full key
    assert engine.count_runs(tag=f"concurrency:{key}") == LIMIT


# -- an idempotent re-start racing the first start (docs/explanation/quotas.md, rule 9) --------


def _restart_engine(quota: Concurrency, store: Any = None) -> Engine:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None, quota)
    return Engine(store, dispatch=lambda engine, run: None, registry=registry)


def wait_for_lock_waiters(count: int, timeout: float = 30) -> None:
    """Poll until ``count`` other backends of this database wait for a lock (PostgreSQL)."""
    deadline = time.monotonic() + timeout
    with connections["default"].cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0] >= count:
                return
            assert time.monotonic() < deadline, "the second start never waited for the first"
            time.sleep(0.01)


def _restart_quota(case: str, key: str) -> Concurrency:
    if case == "reject":
        return Concurrency(key=key, limit=1)
    if case == "round-robin-max-queued":
        return Concurrency(key=key, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN, max_queued=0)
    return Concurrency(key=lambda input: f"{key}:{input['n']}", limit=1)  # the re-start's key differs


@pytest.mark.postgres
@pytest.mark.parametrize("case", ["reject", "round-robin-max-queued", "other-key"])
def test_a_restart_waiting_for_the_first_start_returns_its_run(case: str) -> None:
    """A holds its start of ``turn-42`` open in a transaction; B's start of the same id,
    into a key that is full (by A's run, or by another run), waits for A and returns A's run instead of being refused."""
    key = f"restart:{uuid.uuid4().hex}"
    engine = _restart_engine(_restart_quota(case, key))
    run_id = f"turn-42:{key}"
    if case == "other-key":
        engine.start("w", {"n": 2})  # B's key is full; A's key has room
    with held_open(lambda: engine.start("w", {"n": 1}, run_id=run_id)) as a:
        b = started(lambda: engine.start("w", {"n": 2}, run_id=run_id))
        wait_for_lock_waiters(1)  # B waits for A's transaction
    first, second = a.outcome(), b.outcome()
    assert first.created and not second.created
    assert second.run_id == run_id and second.input == {"n": 1}


@pytest.mark.parametrize("store", ["django", "memory"])
@pytest.mark.parametrize("strategy", [Strategy.REJECT, Strategy.GROUP_ROUND_ROBIN])
def test_threads_restarting_one_run_id_are_never_refused(strategy: Strategy, store: str) -> None:
    """N threads x the same run id, limit 1, several rounds: every start returns the
    run, exactly one is created per id, none is refused."""
    threads, rounds = 6, 10
    key = f"restart-race:{uuid.uuid4().hex}"
    max_queued = 0 if strategy is Strategy.GROUP_ROUND_ROBIN else None
    quota = Concurrency(key=key, limit=1, strategy=strategy, max_queued=max_queued)
    engine = _restart_engine(quota, InMemoryStore() if store == "memory" else None)
    barriers = [threading.Barrier(threads) for _ in range(rounds)]
    created: list[str] = []
    returned: list[str] = []
    refused: list[str] = []

    def starter() -> None:
        for n, barrier in enumerate(barriers):
            barrier.wait(timeout=30)
            try:
                handle = engine.start("w", {}, run_id=f"{key}:{n}")
            except ConcurrencyLimitError as exc:
                refused.append(str(exc))
                continue
            (created if handle.created else returned).append(handle.run_id)
            if handle.created:  # free the slot for the next round's id
                assert engine.store.transition(handle.run_id, from_statuses=["pending"], to="completed")

    for thread in [started(starter) for _ in range(threads)]:
        thread.outcome(120)
    assert refused == []
    assert sorted(created) == [f"{key}:{n}" for n in range(rounds)]
    assert len(returned) == (threads - 1) * rounds


@pytest.mark.postgres
def test_a_wake_up_queued_while_a_slot_frees_is_handed_that_slot() -> None:
    """A suspended run wakes into a full key and is queued; the slot holder is cancelled
    before that commits (its hand-off cannot see the queued run yet). The wake-up hands
    the slot on after its commit, as a start does: the run does not wait for a sweep."""
    key = f"wake:{uuid.uuid4().hex}"
    quota = Concurrency(key=key, limit=1, count_statuses=("pending", "running"), strategy=Strategy.GROUP_ROUND_ROBIN)
    engine = _restart_engine(quota)
    sleeper = engine.start("w", {})
    past = timezone.now() - timedelta(seconds=1)
    assert engine.store.transition(sleeper.run_id, from_statuses=["pending"], to="suspended", waiting_for="sleep", wake_at=past)
    holder = engine.start("w", {})  # "suspended" does not count: the key's slot is the holder's
    assert holder.status == "pending"
    with held_open(lambda: engine.executor.resume(sleeper.refresh().record, due=True)) as waker:
        engine.cancel(holder.run_id)  # its hand-off runs now, before the wake-up commits
    assert waker.outcome() is True
    assert sleeper.refresh().status == "pending"


@pytest.mark.postgres
@pytest.mark.parametrize("lifetime_cap", [True, False])
def test_a_cancel_in_progress_victim_finishing_meanwhile_is_checked(lifetime_cap: bool) -> None:
    """The victim chosen by a CANCEL_IN_PROGRESS start completes (in another transaction)
    before the start can cancel it: the cancel fails, and the start stands only if the
    key has room now. Under a lifetime cap the completed victim still counts: refused."""
    key = f"victim:{uuid.uuid4().hex}"
    counted = ("pending", "running", "suspended", "blocked") + (("completed",) if lifetime_cap else ())
    engine = _restart_engine(Concurrency(key=key, limit=1, count_statuses=counted, strategy=Strategy.CANCEL_IN_PROGRESS))
    victim = engine.start("w", {})
    finish = lambda: engine.store.transition(victim.run_id, from_statuses=["pending"], to="completed")  # noqa: E731
    with held_open(finish) as finisher:
        starter = started(lambda: engine.start("w", {}, run_id=f"{key}:new"))
        wait_for_lock_waiters(1)  # the start waits to cancel the victim, whose row the finisher holds
    assert finisher.outcome() is True
    assert victim.refresh().status == "completed"
    if lifetime_cap:
        with pytest.raises(ConcurrencyLimitError):
            starter.outcome()
        assert engine.store.get_run(f"{key}:new") is None
    else:
        assert starter.outcome().status == "pending"
    assert engine.count_runs(tag=f"concurrency:{key}", statuses=counted) == 1


# -- duplicate deliveries racing to claim one run (docs/explanation/execution.md) --------------
def test_threads_delivered_the_same_run_claim_it_once() -> None:
    registry = Registry()
    calls: list[str] = []
    release = threading.Event()

    def step() -> int:
        calls.append(threading.current_thread().name)
        assert release.wait(30), "the losers never returned"
        return 7

    registry.register("w", "1", lambda ctx, input: ctx.step("s", step))
    engine = Engine(dispatch=lambda engine, run_id: None, registry=registry)
    handle = engine.start("w", {})
    barrier = threading.Barrier(THREADS)
    returned: list[str] = []

    def deliver() -> None:
        try:
            barrier.wait(timeout=30)
            engine.execute(handle.run_id)
        except BaseException:
            release.set()  # do not keep the winner waiting; outcome() raises this below
            raise
        returned.append(threading.current_thread().name)

    threads = [started(deliver) for _ in range(THREADS)]
    try:  # every losing delivery returns while the winner is inside its step
        wait_for(
            lambda: len(returned) >= THREADS - 1 or any(t.error for t in threads),
            timeout=60,
            what="the losing deliveries to return",
        )
    finally:
        release.set()
    for thread in threads:
        thread.outcome()
    assert len(calls) == 1 and len(returned) == THREADS
    assert returned[-1] == calls[0]  # the one claim that won executed the step, after every other delivery returned
    record = handle.refresh().record
    assert (record.status, record.output, record.attempt) == ("completed", 7, 1)
    assert [s.name for s in engine.store.load_steps(handle.run_id)] == ["s"]


def _grr(key: str, limit: int) -> Concurrency:
    return Concurrency(key=key, limit=limit, strategy=Strategy.GROUP_ROUND_ROBIN)


@pytest.mark.postgres
def test_a_queued_start_committing_after_the_slot_freed_is_handed_that_slot() -> None:
    """A start is queued on a full key in a transaction not yet committed; the slot's
    holder finishes meanwhile, and its hand-off cannot see the queued run. The start
    hands the slot on after its commit: the run does not wait for a sweep."""
    key = f"late:{uuid.uuid4().hex}"
    engine = _restart_engine(_grr(key, 1))
    holder = engine.start("w", {})
    with held_open(lambda: engine.start("w", {})) as starter:
        engine.cancel(holder.run_id)  # its hand-off runs now, before the queued start commits
        assert engine.count_runs(f"concurrency:{key}", ["pending", "queued"]) == 0
    queued = starter.outcome()
    assert queued.status == "queued"  # as the start decided it, under the lock
    assert queued.refresh().status == "pending"


@pytest.mark.postgres
def test_a_start_while_a_finish_that_skips_its_hand_off_commits_waits_and_takes_the_slot() -> None:
    """The finish of the key's only run finds no queued run under the key's lock, so no
    hand-off follows it (durable_end answers 0). A start that comes before that commit
    must not queue behind the ending run: it waits for the lock the finish holds, then
    counts the run as ended and is admitted at once. Without the lock it would count
    the run still running, queue, and wait for a sweep, since nobody hands the slot on."""
    key = f"ending:{uuid.uuid4().hex}"
    engine = _restart_engine(_grr(key, 1))
    holder = engine.start("w", {})
    claimed = engine.store.claim_journal(holder.run_id, lease="l", worker="w", stale_before=timezone.now())
    assert claimed is not None
    # A duration sampled just now: the finish writes none to the key's row (which would lock it anyway).
    assert ConcurrencyLock.objects.filter(key=key).update(durations_at=timezone.now()) == 1
    promoted: list[Any] = []
    real_promote = engine.store.promote
    engine.store.promote = lambda *a, **k: promoted.append((a, k)) or real_promote(*a, **k)  # type: ignore[method-assign]
    with held_open(lambda: engine.executor.finish(claimed[0], "l", "completed")) as finisher:
        starter = started(lambda: engine.start("w", {}))
        wait_for_lock_waiters(1)  # the start waits for the key's lock, which the finish holds
    assert finisher.outcome() is True
    started_run = starter.outcome()
    assert started_run.status == "pending"
    assert promoted == []  # no hand-off followed the finish (nor the start, admitted at once)


@pytest.mark.postgres
def test_a_hand_off_needing_a_busy_lock_out_of_key_order_takes_it_in_a_new_call() -> None:
    """durable_promote holds key b (and c) after a first hand-off; the next queued run
    also needs key a, which sorts before them and another transaction holds. Waiting
    for it there could deadlock: the call ends (its first hand-off committed) and a
    new call takes a, b and c in key order, waits for a, and hands the run its slot."""
    run = uuid.uuid4().hex[:8]
    a, b, c = f"{run}:a", f"{run}:b", f"{run}:c"
    engine = _restart_engine(_grr(b, 2))
    r1, r2 = engine.start("w", {}), engine.start("w", {})
    q1 = engine.start("w", {}, concurrency=[_grr(b, 2), _grr(c, 5)])
    q2 = engine.start("w", {}, concurrency=[_grr(a, 5), _grr(b, 2)])
    assert [h.status for h in (r1, r2, q1, q2)] == ["pending", "pending", "queued", "queued"]
    for holder in (r1, r2):  # free both slots of b without handing them on
        assert engine.store.transition(holder.run_id, from_statuses=["pending"], to="completed")
    # Serve q1's group (its other key, c) first: the groups after the cursor come first.
    engine.store.set_rr_cursor(b, f"concurrency:{b}")

    def lock_a() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM durable_concurrencylock WHERE key = %s FOR UPDATE", [a])

    with held_open(lock_a):
        promoter = started(lambda: engine.promoter.promote([b]))
        wait_for_lock_waiters(1)
        # The first call committed q1's hand-off; the second waits for a, holding nothing else.
        assert q1.refresh().status == "pending" and q2.refresh().status == "queued"
    assert promoter.outcome() == [q1.run_id, q2.run_id]
    assert q2.refresh().status == "pending"
