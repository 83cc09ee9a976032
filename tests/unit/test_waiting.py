"""Sleep, signals, child workflows, events, remote queues and versions (their pages in docs/how-to/)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable import (
    ChildWorkflowError,
    Concurrency,
    ConcurrencyLimitError,
    DurableWorkflow,
    Engine,
    InMemoryStore,
    RunStatus,
    Strategy,
)
from durable.exceptions import RunTerminalError, SignalTimeout
from durable.runtime import Registry
from durable.testing import wait_for
from tests.unit.conftest import RecordingDispatcher

# Committed transactions: wake-ups and hand-offs run on commit, as in production.
pytestmark = pytest.mark.django_db(transaction=True)


def run_pending(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    """Execute what was dispatched, like workers would, until nothing is left."""
    while dispatcher.sent:
        engine.execute(dispatcher.sent.pop(0))


def sweep_until_woken(engine: Engine, run_id: str) -> None:
    wait_for(lambda: run_id in engine.sweep()["woken"], timeout=10, what=f"run {run_id} to wake up")


# -- sleep -------------------------------------------------------------------------------


def test_sleep_parks_the_run_with_a_wake_time_then_resumes(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    calls: list[str] = []

    def body(ctx: Any, input: Any) -> str:
        ctx.step("before", calls.append, "before")
        ctx.sleep(1.0)
        ctx.step("after", calls.append, "after")
        return "woke"

    engine.register("w", "1", body)
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    run = handle.refresh().record
    assert run.status == RunStatus.SUSPENDED and run.waiting_for == "sleep"
    assert timedelta(0) < run.wake_at - timezone.now() <= timedelta(seconds=1)
    assert engine.executor.wake_due(handle.run_id) is False  # not yet
    sweep_until_woken(engine, handle.run_id)
    assert timezone.now() >= run.wake_at
    assert engine.executor.wake_due(handle.run_id) is False  # a second timer changes nothing
    run_pending(engine, dispatcher)
    assert handle.result(timeout=1) == "woke"
    assert calls == ["before", "after"]  # "before" was not run again


def test_sleep_until_and_zero_sleep(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    def body(ctx: Any, input: Any) -> str:
        ctx.sleep(0)
        ctx.sleep_until(timezone.now() - timedelta(seconds=5))
        return "no wait"

    engine.register("w", "1", body)
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert handle.result(timeout=1) == "no wait"


@pytest.mark.parametrize("bad", [-1, "10", None])
def test_sleep_rejects_bad_durations(engine: Engine, dispatcher: RecordingDispatcher, bad: Any) -> None:
    engine.register("w", "1", lambda ctx, input: ctx.sleep(bad))
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert handle.refresh().status == RunStatus.FAILED
    assert "sleep() takes a non-negative number" in handle.error["message"]


# -- signals -------------------------------------------------------------------------------


def approval(ctx: Any, input: Any) -> Any:
    return {"approved_by": ctx.wait_for_signal("approve")["user"]}


def test_signal_resumes_a_waiting_run(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", approval)
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert handle.refresh().record.waiting_for == "signal:approve"
    handle.signal("approve", {"user": "ana"})
    assert handle.refresh().status == RunStatus.PENDING
    run_pending(engine, dispatcher)
    assert handle.result(timeout=1) == {"approved_by": "ana"}


def test_signal_sent_before_the_wait_is_buffered(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", approval)
    handle = engine.start("w", {})
    engine.signal(handle.run_id, "approve", {"user": "early"})
    engine.signal(handle.run_id, "other", {"user": "ignored"})
    run_pending(engine, dispatcher)
    assert handle.result(timeout=1) == {"approved_by": "early"}


def test_signal_arriving_between_the_check_and_the_suspend_is_not_lost(engine: Engine, store: Any) -> None:
    engine.register("w", "1", approval)
    handle = engine.start("w", {})
    lease = "l1"
    assert store.claim(handle.run_id, lease=lease, worker="w", stale_before=timezone.now())
    store.add_signal(handle.run_id, "approve", {"user": "racer"})  # lands after the body looked
    assert store.suspend(handle.run_id, lease, waiting_for="signal:approve", wake_at=None) is False
    assert handle.refresh().status == RunStatus.RUNNING  # the executor replays at once instead


def test_signal_timeout_raises_in_the_workflow(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    def body(ctx: Any, input: Any) -> str:
        try:
            ctx.wait_for_signal("approve", timeout=0.5)
        except SignalTimeout:
            return "timed out"
        return "approved"

    engine.register("w", "1", body)
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert handle.refresh().record.wake_at is not None
    sweep_until_woken(engine, handle.run_id)
    run_pending(engine, dispatcher)
    assert handle.result(timeout=1) == "timed out"


def test_signal_to_a_finished_run_is_refused(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: None)
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    with pytest.raises(RunTerminalError, match="cannot receive signals"):
        handle.signal("approve")


def test_parked_run_holds_its_slot_with_the_default_count_statuses(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", approval, concurrency=Concurrency(key="k", limit=1))
    parked = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert parked.refresh().status == RunStatus.SUSPENDED
    with pytest.raises(ConcurrencyLimitError):
        engine.start("w", {})


def test_parked_run_frees_its_slot_with_narrowed_count_statuses(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    quota = Concurrency(key="k", limit=1, count_statuses=["pending", "running"])
    engine.register("w", "1", approval, concurrency=quota)
    parked = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert parked.refresh().status == RunStatus.SUSPENDED
    other = engine.start("w", {})  # the parked run holds no slot
    # The signal comes while the key is full: the parked run waits for a slot, queued.
    parked.signal("approve", {"user": "ana"})
    assert parked.refresh().status == RunStatus.QUEUED
    other.cancel()  # a slot frees: it is handed to the resumed run
    assert parked.refresh().status == RunStatus.PENDING
    run_pending(engine, dispatcher)
    assert parked.result(timeout=1) == {"approved_by": "ana"}


# -- child workflows -------------------------------------------------------------------------


def test_child_result_is_returned_to_the_waiting_parent(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("child", "1", lambda ctx, input: ctx.step("double", lambda: input["n"] * 2))
    engine.register("parent", "1", lambda ctx, input: {"child": ctx.child("child", {"n": 21})})
    parent = engine.start("parent", {})
    engine.execute(dispatcher.sent.pop(0))
    assert parent.refresh().status == RunStatus.SUSPENDED
    [child] = engine.list_runs(workflow="child")
    assert child.record.parent_run_id == parent.run_id
    assert parent.record.waiting_for == f"child:{child.run_id}"
    run_pending(engine, dispatcher)
    assert parent.result(timeout=1) == {"child": 42}


def test_child_failure_raises_child_workflow_error(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    def failing(ctx: Any, input: Any) -> None:
        raise ValueError("bad child")

    def parent_body(ctx: Any, input: Any) -> str:
        try:
            ctx.child("child", {})
        except ChildWorkflowError as exc:
            return f"caught: {exc}"
        return "no error"

    engine.register("child", "1", failing)
    engine.register("parent", "1", parent_body)
    parent = engine.start("parent", {})
    run_pending(engine, dispatcher)
    assert "ended failed: bad child" in parent.result(timeout=1)


def test_child_refused_by_its_quota_is_a_failed_child_with_the_limit_error_as_cause(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    causes: list[Any] = []

    def parent_body(ctx: Any, input: Any) -> str:
        try:
            ctx.child("child", {"tenant": "acme"})
        except ChildWorkflowError as exc:
            causes.append(exc.__cause__)
            return "refused"
        return "started"

    engine.register("child", "1", lambda ctx, input: None, concurrency=Concurrency(key="tenant:acme", limit=1))
    engine.register("parent", "1", parent_body)
    engine.start("child", {})  # fills tenant:acme
    dispatcher.sent.clear()
    parent = engine.start("parent", {})
    run_pending(engine, dispatcher)
    assert parent.result(timeout=1) == "refused"
    [cause] = causes
    assert isinstance(cause, ConcurrencyLimitError)
    assert (cause.key, cause.limit, cause.active) == ("tenant:acme", 1, 1)
    assert engine.count_runs() == 2  # no child run was created


def test_start_child_returns_a_handle_without_waiting(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("child", "1", lambda ctx, input: "done")
    engine.register("parent", "1", lambda ctx, input: ctx.start_child("child", {}).run_id)
    parent = engine.start("parent", {})
    engine.execute(dispatcher.sent.pop(0))
    child_id = parent.result(timeout=1)
    assert engine.get_run(child_id).record.parent_run_id == parent.run_id
    run_pending(engine, dispatcher)
    assert engine.get_run(child_id).result(timeout=1) == "done"


def test_children_inherit_the_namespace_and_are_cancelled_with_the_parent(store: Any, dispatcher: RecordingDispatcher) -> None:
    engine = Engine(store, namespace="tenant-a", dispatch=dispatcher, registry=Registry())
    engine.register("child", "1", approval)
    engine.register("parent", "1", lambda ctx, input: ctx.child("child", {}))
    parent = engine.start("parent", {})
    run_pending(engine, dispatcher)
    [child] = engine.list_runs(workflow="child")
    assert child.namespace == "tenant-a"
    parent.cancel()
    assert child.refresh().status == RunStatus.CANCELLED
    assert "parent" in child.error["message"]


# -- events ------------------------------------------------------------------------------------


def test_emit_starts_every_subscriber_and_skips_a_full_one(engine: Engine) -> None:
    engine.register("mail", "1", lambda ctx, input: None, on_events=["order.created"])
    engine.register(
        "stock", "1", lambda ctx, input: None, on_events=["order.created"], concurrency=Concurrency(key="stock", limit=1)
    )
    engine.register("unrelated", "1", lambda ctx, input: None, on_events=["order.paid"])
    engine.start("stock", {})  # fills the stock quota
    result = engine.emit("order.created", {"order": 7}, event_id="evt-1")
    assert [h.workflow for h in result.started] == ["mail"]
    assert [(s.workflow, type(s.error)) for s in result.skipped] == [("stock", ConcurrencyLimitError)]
    assert result.started[0].run_id == "event:evt-1:mail"
    assert result.started[0].input == {"order": 7}


def test_the_same_event_id_never_starts_a_subscriber_twice(engine: Engine) -> None:
    engine.register("mail", "1", lambda ctx, input: None, on_events=["order.created"])
    first = engine.emit("order.created", {}, event_id="evt-1")
    again = engine.emit("order.created", {}, event_id="evt-1")
    assert len(first.started) == 1 and again.started == []
    assert [h.run_id for h in again.duplicates] == ["event:evt-1:mail"]
    assert engine.count_runs() == 1


def test_workflow_class_subscribes_to_events() -> None:
    registry = Registry()
    engine = Engine(InMemoryStore(), dispatch=lambda engine, run: None, registry=registry)

    class Receipt(DurableWorkflow):
        name = "receipt"
        on_events = ["order.paid"]

        def run(self, ctx: Any, input: Any) -> None: ...

    Receipt.engine = engine  # type: ignore[misc]
    registry.register("receipt", "1", Receipt._execute, on_events=Receipt.on_events)
    assert [d.name for d in registry.subscribers("order.paid")] == ["receipt"]


# -- remote workflows ----------------------------------------------------------------------------


def test_remote_run_is_blocked_without_a_worker_and_goes_when_one_appears(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    engine.register_remote("billing.charge", "1", queue="billing", concurrency=Concurrency(key="billing", limit=1))
    handle = engine.start("billing.charge", {"amount": 5})
    assert handle.record.queue == "billing"
    assert engine.executor.check_remote_queues(live_queues=["celery"]) == ([handle.run_id], [])
    assert handle.refresh().status == RunStatus.BLOCKED
    with pytest.raises(ConcurrencyLimitError):  # a blocked run still holds its slot
        engine.start("billing.charge", {"amount": 6})
    dispatcher.sent.clear()
    assert engine.executor.check_remote_queues(live_queues=["billing"]) == ([], [handle.run_id])
    assert handle.refresh().status == RunStatus.PENDING
    assert dispatcher.sent == [handle.run_id]


def test_remote_workflow_body_is_not_run_by_a_worker_that_only_declares_it(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    engine.register_remote("billing.charge", "1", queue="billing")
    handle = engine.start("billing.charge", {})
    run_pending(engine, dispatcher)
    assert handle.refresh().status == RunStatus.FAILED
    assert "is remote here" in handle.error["message"]


# -- versions -------------------------------------------------------------------------------------


def test_in_flight_runs_finish_on_the_version_they_started_on(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: ctx.step("a", lambda: "v1"))
    old = engine.start("w", {})
    engine.register("w", "2", lambda ctx, input: ctx.step("b", lambda: "v2"))
    new = engine.start("w", {})
    pinned = engine.start("w", {}, version="1")
    run_pending(engine, dispatcher)
    assert (old.record.version, new.record.version, pinned.record.version) == ("1", "2", "1")
    assert [old.result(timeout=1), new.result(timeout=1), pinned.result(timeout=1)] == ["v1", "v2", "v1"]


def test_child_with_the_run_id_of_a_foreign_run_fails_instead_of_waiting_forever(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    engine.register("child", "1", approval)
    engine.register("parent", "1", lambda ctx, input: ctx.child("child", {}, run_id="not-mine"))
    engine.start("child", {}, run_id="not-mine")  # exists already, started by nobody's parent
    parent = engine.start("parent", {})
    run_pending(engine, dispatcher)
    assert parent.refresh().status == RunStatus.FAILED
    assert "is not a child of" in parent.error["message"]


def test_a_blocked_run_that_held_no_slot_comes_back_queued_when_its_key_is_full(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    quota = Concurrency(key="billing", limit=1, count_statuses=["pending", "running"])
    engine.register_remote("billing.charge", "1", queue="billing", concurrency=quota)
    first = engine.start("billing.charge", {})
    assert engine.executor.check_remote_queues(live_queues=[]) == ([first.run_id], [])
    second = engine.start("billing.charge", {})  # the blocked run holds no slot
    assert second.status == RunStatus.PENDING
    assert engine.executor.check_remote_queues(live_queues=["billing"], block=False) == ([], [first.run_id])
    assert first.refresh().status == RunStatus.QUEUED  # the key is full: it waits its turn
    second.cancel()
    assert first.refresh().status == RunStatus.PENDING


def test_a_worker_start_only_unblocks(engine: Engine) -> None:
    engine.register_remote("billing.charge", "1", queue="billing")
    engine.register_remote("mail.send", "1", queue="mail")
    charge = engine.start("billing.charge", {})
    assert engine.executor.check_remote_queues(live_queues=["other"], block=False) == ([], [])
    assert charge.refresh().status == RunStatus.PENDING


def test_wake_ups_and_hand_offs_count_in_the_run_namespace_when_reads_are_fenced(
    store: Any, dispatcher: RecordingDispatcher
) -> None:
    registry = Registry()
    tenant = Engine(store, namespace="tenant-a", scope_reads=True, dispatch=dispatcher, registry=registry)
    worker = Engine(store, namespace="default", scope_reads=True, dispatch=dispatcher, registry=registry)
    quota = Concurrency(key="k", limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)
    registry.register("w", "1", lambda ctx, input: None, quota)
    first, second = tenant.start("w", {}), tenant.start("w", {})
    assert second.status == RunStatus.QUEUED
    worker.execute(dispatcher.sent.pop(0))  # the worker's own engine is another namespace's
    assert first.refresh().status == RunStatus.COMPLETED
    assert second.refresh().status == RunStatus.PENDING
