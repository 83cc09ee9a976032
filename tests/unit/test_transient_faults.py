"""Transient faults of durable's own infrastructure are never a workflow's failure;
recorded step failures replay as what the workflow caught the first time."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from durable import DjangoStore, Engine, FatalError, RunStatus
from durable.runtime import Registry
from tests.unit.conftest import RecordingDispatcher

pytestmark = pytest.mark.django_db


class PaymentDeclined(Exception):
    """A workflow's own exception (module level: a replay can find its class)."""

    def __init__(self, reason: str, amount: int) -> None:
        super().__init__(reason, amount)
        self.reason, self.amount = reason, amount


def break_store(store: Any, method: str, *, times: int, after: bool = False) -> list[int]:
    """Make ``store.<method>`` raise a dropped-connection error the next ``times`` calls
    (a fault injected at the store's edge, as the database driver raises it); with
    ``after``, once the call did its work: the connection broke after the statement
    committed, before its answer came."""
    real: Callable[..., Any] = getattr(store, method)
    failures: list[int] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if len(failures) >= times:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        failures.append(1)
        raise OperationalError("terminating connection due to administrator command")

    setattr(store, method, call)
    return failures


@pytest.fixture
def queued(store: Any, dispatcher: RecordingDispatcher) -> Engine:
    return Engine(store, dispatch=dispatcher, registry=Registry())


# -- 1 + 7: a dropped connection is not the workflow's failure ------------------------------
def test_a_failed_journal_write_ends_the_execution_without_a_verdict(queued: Engine, store: Any) -> None:
    calls: list[str] = []
    queued.register("w", "1", lambda ctx, input: ctx.step("a", lambda: calls.append("a") or 1))
    handle = queued.start("w", {})
    break_store(store, "record_step", times=1)
    assert queued.executor.execute(handle.run_id) is True  # deliver again later

    record = handle.refresh().record
    assert record.status == RunStatus.PENDING  # handed back, not failed
    assert record.error is None and record.lease == ""
    assert record.attempt == 0  # an interrupted execution does not count towards MAX_ATTEMPTS
    queued.execute(handle.run_id)  # the redelivery
    assert handle.result(timeout=1) == 1
    assert handle.record.attempt == 1


def test_the_body_cannot_catch_durables_own_store_errors(queued: Engine, store: Any) -> None:
    caught: list[BaseException] = []

    def body(ctx: Any, input: Any) -> Any:
        try:
            return ctx.step("a", lambda: "done")
        except Exception as exc:  # noqa: BLE001  (a body taking "another path" on any error)
            caught.append(exc)
            return "other path"

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    break_store(store, "record_step", times=1)
    queued.execute(handle.run_id)
    assert caught == []
    assert handle.refresh().status == RunStatus.PENDING
    queued.execute(handle.run_id)
    assert handle.result(timeout=1) == "done"
    assert caught == []


def journal_read(store: Any) -> str:
    """The store method an execution reads its journal with: on PostgreSQL the
    Django store reads it with the claim (``durable_claim``)."""
    return "claim_journal" if isinstance(store, DjangoStore) and connection.vendor == "postgresql" else "load_steps"


@pytest.mark.parametrize("method", ["journal", "suspend", "finish", "holds"])
def test_a_store_error_anywhere_in_an_execution_is_not_a_failure(queued: Engine, store: Any, method: str) -> None:
    if method == "journal":
        method = journal_read(store)

    def body(ctx: Any, input: Any) -> Any:
        value = ctx.step("a", lambda: 1)
        # Not the first step after the claim: it checks the lease (holds) before it runs.
        ctx.step("b", lambda: 2)
        ctx.sleep(0 if input.get("woken") else 3600)
        return value

    queued.register("w", "1", body)
    handle = queued.start("w", {"woken": method != "suspend"})
    # A claim that lost its connection is tried again at once: break both tries.
    break_store(store, method, times=2 if method == "claim_journal" else 1)
    queued.execute(handle.run_id)
    record = handle.refresh().record
    assert record.status == RunStatus.PENDING and record.error is None
    queued.execute(handle.run_id)
    if method == "suspend":
        assert handle.refresh().status == RunStatus.SUSPENDED
    else:
        assert handle.result(timeout=1) == 1


def test_a_claim_that_fails_twice_leaves_the_run_pending_and_asks_for_redelivery(queued: Engine, store: Any) -> None:
    queued.register("w", "1", lambda ctx, input: 7)
    handle = queued.start("w", {})
    failures = break_store(store, "claim_journal", times=2)  # what the engine calls to claim
    assert queued.executor.execute(handle.run_id) is True
    assert len(failures) == 2  # the claim lost its connection, and again on a new one
    assert handle.refresh().status == RunStatus.PENDING
    assert queued.executor.execute(handle.run_id) is False
    assert handle.result(timeout=1) == 7


@pytest.mark.parametrize("after", [False, True], ids=["before-the-claim", "after-it-committed"])
def test_a_claim_that_lost_its_connection_once_is_claimed_again_at_once(queued: Engine, store: Any, after: bool) -> None:
    """A connection that died while it was idle (a database restart) costs no redelivery;
    one that broke after the claim committed is handed back with its attempt taken back
    before the claim is made again, so the run executes once, at attempt 1 (not 2)."""
    queued.register("w", "1", lambda ctx, input: 7)
    handle = queued.start("w", {})
    failures = break_store(store, "claim_journal", times=1, after=after)
    assert queued.executor.execute(handle.run_id) is False
    assert failures == [1]
    assert handle.result(timeout=1) == 7
    assert handle.record.attempt == 1


def test_claims_whose_answers_were_lost_twice_count_no_attempt(queued: Engine, store: Any, settings: Any) -> None:
    """Lost connections never bring a run closer to dead: the run is left pending with
    no attempt counted, even when every claim committed before its connection broke."""
    settings.DURABLE = {**settings.DURABLE, "MAX_ATTEMPTS": 1}
    queued.register("w", "1", lambda ctx, input: 7)
    handle = queued.start("w", {})
    break_store(store, "claim_journal", times=4, after=True)
    assert queued.executor.execute(handle.run_id) is True  # redelivery asked for
    record = handle.refresh().record
    assert (record.status, record.attempt, record.lease) == (RunStatus.PENDING, 0, "")
    assert queued.executor.execute(handle.run_id) is True
    assert handle.refresh().record.attempt == 0
    queued.execute(handle.run_id)  # with MAX_ATTEMPTS 1, a counted loss would have made it dead
    assert handle.result(timeout=1) == 7
    assert handle.record.attempt == 1


def test_a_claim_that_fails_otherwise_is_not_tried_again_at_once(queued: Engine, store: Any) -> None:
    queued.register("w", "1", lambda ctx, input: 7)
    handle = queued.start("w", {})
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("a bug in a custom store")

    store.claim_journal = broken
    assert queued.executor.execute(handle.run_id) is True
    assert calls == [1]
    assert handle.refresh().status == RunStatus.PENDING


# -- 3: a cancel between journaling a sleep and parking the run ------------------------------
def test_a_cancel_before_the_run_parks_stops_the_worker(queued: Engine) -> None:
    bodies: list[int] = []

    def body(ctx: Any, input: Any) -> Any:
        bodies.append(1)
        if len(bodies) > 3:
            raise RuntimeError("the worker keeps replaying a run it no longer owns")
        try:
            ctx.sleep(3600)  # journals the sleep, then parks the run
        finally:
            if len(bodies) == 1:  # the run is cancelled in between
                queued.cancel(ctx.run_id)

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert bodies == [1]
    assert handle.refresh().status == RunStatus.CANCELLED


# -- 2: lease loss ------------------------------------------------------------------------
def test_a_worker_that_lost_its_lease_neither_journals_nor_calls_the_next_step(queued: Engine, store: Any) -> None:
    calls: list[str] = []

    def take_over(run_id: str) -> str:
        calls.append("first")
        # Meanwhile the sweeper presumed this worker dead and another worker claimed the run.
        assert store.claim(run_id, lease="other", worker="w2", stale_before=timezone.now() + timedelta(hours=1))
        return "first"

    def body(ctx: Any, input: Any) -> Any:
        ctx.step("first", take_over, ctx.run_id)
        ctx.step("second", lambda: calls.append("second"))

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert calls == ["first"]
    assert store.load_steps(handle.run_id) == []
    record = handle.refresh().record
    assert (record.status, record.lease) == (RunStatus.RUNNING, "other")


# -- 6: a caught step failure is caught again on replay ----------------------------------------
def _charge(amount: int) -> None:
    raise PaymentDeclined("insufficient funds", amount)


def _refuse() -> None:
    raise FatalError("card blocked")


@pytest.mark.parametrize("fn, caught_as", [(_charge, PaymentDeclined), (_refuse, FatalError)])
def test_a_caught_step_failure_is_caught_the_same_way_after_a_sleep(
    queued: Engine, store: Any, fn: Callable[..., None], caught_as: type[Exception]
) -> None:
    seen: list[tuple[str, str, Any]] = []

    def body(ctx: Any, input: Any) -> Any:
        try:
            ctx.step("charge", fn, *input["args"], retries=2, backoff=0)
        except caught_as as exc:
            seen.append((type(exc).__name__, str(exc), getattr(exc, "amount", None)))
        ctx.sleep(3600)
        return "took the other path"

    queued.register("w", "1", body)
    args = [25] if fn is _charge else []
    handle = queued.start("w", {"args": args})
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.SUSPENDED
    # Wake it now (the timer of a long sleep), and replay.
    store.transition(handle.run_id, from_statuses=["suspended"], to="suspended", wake_at=timezone.now())
    assert queued.executor.wake_due(handle.run_id)
    queued.execute(handle.run_id)
    assert handle.refresh().status != RunStatus.FAILED, handle.error
    assert len(seen) == 2
    assert seen[0] == seen[1]
    assert seen[0][0] == caught_as.__name__


class Unbuildable(Exception):
    """Its constructor takes a keyword the journal cannot replay."""

    def __init__(self, *, code: object) -> None:
        super().__init__(f"refused: {code}")


def test_a_failure_that_cannot_be_rebuilt_replays_as_a_step_failed_error_of_its_class(queued: Engine) -> None:
    from durable.runtime.context import StepFailedError

    class Local(Exception):
        """Defined in a function: a replay cannot find it."""

    seen: list[tuple[bool, bool, str]] = []

    def body(ctx: Any, input: Any) -> Any:
        for name, error in (("a", Unbuildable(code={1})), ("b", Local("local"))):
            try:
                ctx.step(name, _raise, error)
            except Exception as exc:  # noqa: BLE001
                seen.append((isinstance(exc, Unbuildable), isinstance(exc, StepFailedError), str(exc)))
        ctx.sleep(3600)

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert seen == [(True, False, "refused: {1}"), (False, False, "local")]
    queued.store.transition(handle.run_id, from_statuses=["suspended"], to="suspended", wake_at=timezone.now())
    assert queued.executor.wake_due(handle.run_id)
    queued.execute(handle.run_id)
    assert seen[2:] == [
        (True, True, "Step 'a' failed: refused: {1}"),  # except Unbuildable still catches it
        (False, True, "Step 'b' failed: local"),
    ]
    assert handle.refresh().status == RunStatus.SUSPENDED


def _raise(error: Exception) -> None:
    raise error


# -- 5: the sweeper re-sends with a growing delay ------------------------------------------
def test_a_run_promoted_from_queued_is_not_sent_again_by_the_next_sweep(store: Any, settings: Any) -> None:
    from durable import Concurrency, Strategy

    sent: list[str] = []
    engine = Engine(store, dispatch=lambda engine, run: sent.append(run.run_id), registry=Registry())
    engine.register(
        "w",
        "1",
        lambda ctx, input: None,
        concurrency=Concurrency(key="k", limit=1, strategy=Strategy.GROUP_ROUND_ROBIN),
    )
    holder = engine.start("w", {})
    waiter = engine.start("w", {})
    assert waiter.status == RunStatus.QUEUED
    long_ago = timezone.now() - timedelta(hours=1)  # it waited in the queue for an hour
    store.transition(waiter.run_id, from_statuses=["queued"], to="queued", dispatched_at=long_ago)
    holder.cancel()  # hands its slot to the queued run (or the sweep does), which is sent then
    engine.sweep()
    assert waiter.refresh().status == RunStatus.PENDING
    assert sent.count(waiter.run_id) == 1
    assert engine.sweep()["undelivered"] == []
    assert sent.count(waiter.run_id) == 1


def test_the_sweeper_resends_a_pending_run_with_a_growing_delay(store: Any, settings: Any) -> None:
    after = float(settings.DURABLE["REDISPATCH_AFTER"])
    sent: list[str] = []
    engine = Engine(store, dispatch=lambda engine, run: sent.append(run.run_id), registry=Registry())
    engine.register("w", "1", lambda ctx, input: None)
    handle = engine.start("w", {})
    sent.clear()

    def last_sent(seconds_ago: float) -> None:
        at = timezone.now() - timedelta(seconds=seconds_ago)
        store.transition(
            handle.run_id,
            from_statuses=["pending"],
            to="pending",
            dispatched_at=at,
            redispatches=handle.refresh().record.redispatches,
        )

    last_sent(after * 1.5)
    assert engine.sweep()["undelivered"] == [handle.run_id]  # 1st re-send after REDISPATCH_AFTER
    assert handle.refresh().record.redispatches == 1
    last_sent(after * 1.5)
    assert engine.sweep()["undelivered"] == []  # the 2nd waits twice as long
    last_sent(after * 2.5)
    assert engine.sweep()["undelivered"] == [handle.run_id]
    last_sent(after * 3.5)
    assert engine.sweep()["undelivered"] == []  # the 3rd, four times as long
    last_sent(after * 4.5)
    assert engine.sweep()["undelivered"] == [handle.run_id]
    assert sent == [handle.run_id] * 3
    engine.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.COMPLETED


def test_an_orphaned_run_is_not_resent_on_every_sweep(store: Any, settings: Any) -> None:
    sent: list[str] = []
    engine = Engine(store, dispatch=lambda engine, run: sent.append(run.run_id), registry=Registry())
    engine.register("w", "1", lambda ctx, input: None)
    handle = engine.start("w", {})
    sent.clear()
    past = timezone.now() - timedelta(hours=1)
    store.transition(handle.run_id, from_statuses=["pending"], to="pending", dispatched_at=past)
    store.claim(handle.run_id, lease="gone", worker="w1", stale_before=timezone.now())
    store.transition(handle.run_id, from_statuses=["running"], to="running", heartbeat_at=past)
    assert engine.sweep()["orphaned"] == [handle.run_id]  # found orphaned: re-sent at once
    assert engine.sweep()["orphaned"] == []  # its message was just sent: no second one yet
    assert sent == [handle.run_id]
    after = float(settings.DURABLE["REDISPATCH_AFTER"])
    at = timezone.now() - timedelta(seconds=after * 2.5)  # the 2nd re-send waits 2 * REDISPATCH_AFTER
    store.transition(handle.run_id, from_statuses=["running"], to="running", dispatched_at=at)
    assert engine.sweep()["orphaned"] == [handle.run_id]
    assert sent == [handle.run_id] * 2


def test_a_store_error_that_repeats_on_every_execution_ends_the_run_dead(queued: Engine, store: Any, settings: Any) -> None:
    """Not a dropped connection (a bug, a value the database refuses): each
    interrupted execution counts, so it cannot be redelivered forever."""
    settings.DURABLE = {**settings.DURABLE, "MAX_ATTEMPTS": 2}
    queued.register("w", "1", lambda ctx, input: ctx.step("a", lambda: 1))
    handle = queued.start("w", {})
    real = store.record_step

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the database refuses this value")

    store.record_step = refuse
    assert queued.executor.execute(handle.run_id) is True
    assert queued.executor.execute(handle.run_id) is True
    assert handle.refresh().status == RunStatus.PENDING and handle.record.attempt == 2
    assert queued.executor.execute(handle.run_id) is False
    assert handle.refresh().status == RunStatus.DEAD
    store.record_step = real


@pytest.mark.parametrize("store", ["django"], indirect=True)
def test_the_celery_task_asks_celery_to_redeliver_an_interrupted_run(store: Any, settings: Any) -> None:
    from durable import engine as default_engine
    from durable import tasks

    assert [tasks.redelivery_delay(n) for n in range(8)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 2.0]
    handle = default_engine.start("test.add", {"a": 1, "b": 2, "key": "redeliver"})
    failures = break_store(default_engine.store, "record_step", times=1)
    try:
        result = tasks.execute_run.apply(args=(handle.run_id,))  # eager: a retry runs at once
    finally:
        del default_engine.store.record_step  # the instance attribute break_store set
    assert failures == [1]
    assert result.successful()
    assert handle.result(timeout=1) == {"total": 3}
    assert handle.record.attempt == 1


def test_the_sweeper_wakes_a_parent_whose_child_ended_without_waking_it(
    queued: Engine, store: Any, dispatcher: RecordingDispatcher
) -> None:
    queued.register("child", "1", lambda ctx, input: 5)
    queued.register("parent", "1", lambda ctx, input: {"child": ctx.child("child", {})})
    parent = queued.start("parent", {})
    queued.execute(parent.run_id)
    assert parent.refresh().status == RunStatus.SUSPENDED
    [child] = queued.list_runs(workflow="child")
    # The child's worker finishes it, then loses the database before waking the parent.
    assert store.claim(child.run_id, lease="l", worker="w", stale_before=timezone.now())
    assert store.finish(child.run_id, "l", status=RunStatus.COMPLETED, output=5)
    assert parent.refresh().status == RunStatus.SUSPENDED
    assert queued.sweep()["woken"] == [parent.run_id]
    assert parent.refresh().status == RunStatus.PENDING
    queued.execute(parent.run_id)
    assert parent.result(timeout=1) == {"child": 5}
    assert queued.sweep()["woken"] == []
