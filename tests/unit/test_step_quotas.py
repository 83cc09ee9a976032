"""Step-level quotas, ``ctx.step(..., concurrency=Concurrency(...))`` (docs/how-to/step-quotas.md),
on the ORM path (SQLite, or PostgreSQL with DATABASE_URL) and the in-memory store.

A step body that starts another run's execution (nested, in the same thread)
is how these tests have a step inside its body while another one asks for the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable import Burst, Concurrency, ConcurrencyLimitError, Engine, InMemoryStore, RunStatus, Strategy
from durable.conf import settings as durable_settings
from durable.exceptions import InvalidStartError
from durable.runtime.context import WorkflowContext
from durable.stores.base import BaseStore
from tests.unit.conftest import RecordingDispatcher

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "provider:openai"


def run_pending(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    while dispatcher.sent:
        engine.execute(dispatcher.sent.pop(0))


def held(store: BaseStore) -> list[tuple[str, int, str]]:
    """(run id, position, status) of every step slot row, in arrival order."""
    if isinstance(store, InMemoryStore):
        return [(s.run_id, s.position, s.status) for s in store._slots.values()]
    from durable.models import StepSlot

    return list(StepSlot.objects.order_by("id").values_list("run__run_id", "position", "status"))


def limited(engine: Engine, *, limit: int = 1, strategy: Strategy | None = None, nested: dict[str, str] | None = None) -> list:
    """Register workflow ``w``: one step ``gen`` under the quota; the step of run X
    executes run ``nested[X]`` inside its body. Returns the log of bodies entered and left."""
    log: list[tuple[str, str]] = []
    quota = Concurrency(key=KEY, limit=limit) if strategy is None else Concurrency(key=KEY, limit=limit, strategy=strategy)

    def call(run_id: str) -> str:
        log.append(("in", run_id))
        if nested and run_id in nested:
            engine.execute(nested[run_id])
        log.append(("out", run_id))
        return f"done {run_id}"

    def body(ctx: Any, input: Any) -> Any:
        try:
            return ctx.step("gen", call, ctx.run_id, concurrency=quota)
        except ConcurrencyLimitError:
            ctx.wait_for_signal("again")
            return ctx.step("gen", call, ctx.run_id, concurrency=quota)

    engine.register("w", "1", body)
    return log


def test_a_full_key_parks_the_step_until_the_slot_is_handed_to_it(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    log = limited(engine, nested={"a": "b"})
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")  # b runs inside a's step
    engine.execute(dispatcher.sent.pop(0))
    assert log == [("in", "a"), ("out", "a")]  # b asked while a held the only slot: it waits
    assert engine.get_run("a").status == RunStatus.COMPLETED
    assert dispatcher.sent == ["b"]  # a's journaled result handed the slot to b, which was sent
    assert held(engine.store) == [("b", 0, "held")]
    run_pending(engine, dispatcher)
    assert log == [("in", "a"), ("out", "a"), ("in", "b"), ("out", "b")]
    assert engine.get_run("b").result() == "done b"
    assert held(engine.store) == []


def test_the_parked_run_holds_no_worker_and_waits_for_its_slot(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    seen: dict[str, Any] = {}

    def inside(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")
            seen["b"] = engine.get_run("b").record
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", inside, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    engine.execute(dispatcher.sent.pop(0))
    assert seen["b"].status == RunStatus.SUSPENDED and seen["b"].waiting_for == f"slot:{KEY}"
    assert seen["b"].lease == ""


def test_waiters_get_slots_in_arrival_order(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    order = ["b", "c", "d"]
    log = limited(engine, limit=1, nested={"a": "b"})
    # a's step runs b, c and d in turn: each finds the key full and parks, in that order.

    def call(run_id: str) -> str:
        log.append(("in", run_id))
        if run_id == "a":
            for other in order:
                engine.execute(other)
        log.append(("out", run_id))
        return run_id

    engine.register("w2", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    for run_id in ["a", *order]:
        engine.start("w2", {}, run_id=run_id)
    del dispatcher.sent[1:]
    run_pending(engine, dispatcher)
    assert [run_id for what, run_id in log if what == "in"] == ["a", "b", "c", "d"]
    assert all(engine.get_run(r).status == RunStatus.COMPLETED for r in ["a", *order])


def test_at_most_limit_bodies_at_once(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    inside: list[str] = []
    peak = [0]
    parked: list[str] = []

    def call(run_id: str) -> str:
        inside.append(run_id)
        peak[0] = max(peak[0], len(inside))
        n = int(run_id[1:])
        if n < 3:
            engine.execute(f"r{n + 1}")  # r0 runs r1 inside its step, r1 runs r2, r2 runs r3
            if n == 2:
                parked.append(engine.get_run("r3").status)
        inside.remove(run_id)
        return run_id

    engine.register("w2", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=3)))
    for i in range(5):
        engine.start("w2", {}, run_id=f"r{i}")
    del dispatcher.sent[1:4]  # r1..r3 run nested; r4 later
    run_pending(engine, dispatcher)
    assert peak[0] == 3  # r0, r1 and r2 in their bodies at once; r3 found the key full
    assert parked == [RunStatus.SUSPENDED]
    assert all(engine.get_run(f"r{i}").status == RunStatus.COMPLETED for i in range(5))


def test_reject_raises_into_the_workflow_journaled_and_replayed_without_asking(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = limited(engine, strategy=Strategy.REJECT, nested={"a": "b"})
    asked: list[str] = []
    acquire = engine.store.acquire_slot

    def counting(run_id: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(run_id)
        return acquire(run_id, *args, **kwargs)

    monkeypatch.setattr(engine.store, "acquire_slot", counting)
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    engine.execute(dispatcher.sent.pop(0))
    assert asked == ["a", "b"]
    b = engine.get_run("b").record
    assert b.status == RunStatus.SUSPENDED and b.waiting_for == "signal:again"  # it caught the refusal
    step = engine.store.load_steps("b")[0]
    assert (step.name, step.outcome) == ("gen", "failed")
    assert step.error["quota"]["key"] == KEY and step.error["quota"]["active"] == 1
    assert held(engine.store) == []  # a gave its slot back; b never held one
    engine.signal("b", "again")
    run_pending(engine, dispatcher)
    # The replay raised the journaled refusal at position 0 without asking again
    # (the key is free now): then the second "gen" step asked, and got the slot.
    assert asked == ["a", "b", "b"]
    assert engine.get_run("b").status == RunStatus.COMPLETED
    assert engine.get_run("b").record.output == "done b"
    assert [s.outcome for s in engine.store.load_steps("b")] == ["failed", "completed", "completed"]
    assert log == [("in", "a"), ("out", "a"), ("in", "b"), ("out", "b")]


def test_a_retry_replays_a_caught_refusal_as_the_first_execution_saw_it(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    quota = Concurrency(key=KEY, limit=1, strategy=Strategy.REJECT)
    save_fails = {"b": True}

    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")  # b is refused while a holds the slot
        return f"primary {run_id}"

    def save(run_id: str, reply: str) -> str:
        if save_fails.get(run_id):
            raise RuntimeError("the database of replies is down")
        return reply

    def body(ctx: Any, input: Any) -> Any:
        try:
            reply = ctx.step("generate", call, ctx.run_id, concurrency=quota)
        except ConcurrencyLimitError:
            reply = ctx.step("fallback", lambda: "fallback reply")
        return ctx.step("save", save, ctx.run_id, reply)

    engine.register("w", "1", body)
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.clear()
    engine.execute("a")
    assert engine.get_run("b").status == RunStatus.FAILED  # refused, fell back, then "save" failed
    save_fails["b"] = False
    engine.retry("b")  # the key is free now: asking it again would take the other branch
    run_pending(engine, dispatcher)
    b = engine.get_run("b").record
    assert (b.status, b.output) == (RunStatus.COMPLETED, "fallback reply"), b.error
    assert [(s.name, s.outcome) for s in engine.store.load_steps("b")] == [
        ("generate", "failed"),
        ("fallback", "completed"),
        ("save", "completed"),
    ]


def test_a_replayed_refusal_is_the_same_error(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    errors: list[ConcurrencyLimitError] = []

    def body(ctx: Any, input: Any) -> str:
        try:
            ctx.step("gen", str, 1, concurrency=Concurrency(key=KEY, limit=0, strategy=Strategy.REJECT))
        except ConcurrencyLimitError as exc:
            errors.append(exc)
        ctx.wait_for_signal("go")
        return "ok"

    engine.register("w", "1", body)
    engine.start("w", {}, run_id="a")
    run_pending(engine, dispatcher)
    engine.signal("a", "go")
    run_pending(engine, dispatcher)
    assert engine.get_run("a").status == RunStatus.COMPLETED
    first, replayed = errors
    assert type(replayed) is ConcurrencyLimitError
    assert (replayed.key, replayed.limit, replayed.active, replayed.workflow, str(replayed)) == (
        first.key,
        first.limit,
        first.active,
        first.workflow,
        str(first),
    )


def test_a_limit_of_zero_refuses_even_a_waiting_step(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: ctx.step("gen", str, 1, concurrency=Concurrency(key=KEY, limit=0)))
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert handle.refresh().status == RunStatus.FAILED
    assert "Concurrency limit reached" in handle.record.error["message"]


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (Concurrency(key=KEY, limit=1, strategy=Strategy.CANCEL_IN_PROGRESS), InvalidStartError),
        (Concurrency(key=KEY, limit=1, strategy=Strategy.CANCEL_NEWEST), InvalidStartError),
        (Concurrency(key=KEY, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN, max_queued=2), InvalidStartError),
        (Concurrency(key=KEY, limit=1, count_statuses=["running"]), InvalidStartError),
        (Concurrency(key=KEY, limit=1, burst=Burst(pool="global", up_to=3)), InvalidStartError),
        (Concurrency(key=KEY, limit=1, strategy=Strategy.REJECT, burst=Burst(pool="global", up_to=3)), InvalidStartError),
        ([Concurrency(key=KEY, limit=1)], TypeError),
        ("provider", TypeError),
    ],
)
def test_bad_step_quotas_are_refused_at_the_call(
    engine: Engine, dispatcher: RecordingDispatcher, spec: Any, error: type[Exception], settings: Any
) -> None:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {"global": 5}}  # a burst's pool exists: it is still refused
    caught: list[Exception] = []
    calls: list[int] = []

    def body(ctx: Any, input: Any) -> str:
        try:
            ctx.step("gen", calls.append, 1, concurrency=spec)
        except Exception as exc:
            caught.append(exc)
        return "ok"

    engine.register("w", "1", body)
    handle = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert handle.refresh().status == RunStatus.COMPLETED
    assert [type(e) for e in caught] == [error] and calls == []
    assert engine.store.load_steps(handle.run_id) == []  # nothing journaled, no position taken
    assert held(engine.store) == []


def test_a_replaced_step_quota_keeps_its_strategy_given_or_not(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    shared = Concurrency(key=KEY, limit=1)
    waiting = dataclasses.replace(shared, limit=2)  # e.g. a bigger limit derived from a shared quota
    refusing = dataclasses.replace(shared, strategy=Strategy.REJECT)
    assert not waiting.strategy_given and waiting.limit == 2
    assert refusing.strategy_given and refusing.strategy is Strategy.REJECT
    assert not dataclasses.replace(refusing, strategy=shared.strategy).strategy_given
    assert dataclasses.replace(refusing, limit=2).strategy_given
    assert shared.strategy == Strategy.REJECT and Strategy(shared.strategy) is Strategy.REJECT  # what a run's quota does
    assert shared == Concurrency(key=KEY, limit=1) and shared != refusing  # they behave differently in a step
    assert dataclasses.replace(waiting, limit=1) == shared

    def body(ctx: Any, input: Any) -> Any:
        quota = dataclasses.replace(shared, limit=1)
        return ctx.step("gen", lambda: engine.execute("b") if ctx.run_id == "a" else "b", concurrency=quota)

    engine.register("w", "1", body)
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.clear()
    engine.execute("a")
    assert engine.get_run("b").status == RunStatus.PENDING  # it waited for a's slot, and was handed it
    assert engine.store.load_steps("b") == []  # not refused
    run_pending(engine, dispatcher)
    assert engine.get_run("b").result() == "b"


def test_group_round_robin_is_the_explicit_name_of_waiting(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    log = limited(engine, strategy=Strategy.GROUP_ROUND_ROBIN, nested={"a": "b"})
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    run_pending(engine, dispatcher)
    assert log == [("in", "a"), ("out", "a"), ("in", "b"), ("out", "b")]


def test_a_key_function_reads_the_run_input_and_none_is_unlimited(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    quota = Concurrency(key=lambda input: input.get("provider"), limit=1)
    engine.register("w", "1", lambda ctx, input: ctx.step("gen", str, input, concurrency=quota))
    limited_run = engine.start("w", {"provider": "p1"})
    free_run = engine.start("w", {})
    run_pending(engine, dispatcher)
    assert limited_run.refresh().status == free_run.refresh().status == RunStatus.COMPLETED
    assert held(engine.store) == []


def test_a_failing_step_gives_its_slot_back(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")
            raise RuntimeError("provider down")
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    run_pending(engine, dispatcher)
    assert engine.get_run("a").status == RunStatus.FAILED
    assert engine.get_run("b").status == RunStatus.COMPLETED


def test_the_slot_is_given_back_when_the_step_is_journaled_not_when_the_run_ends(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    def body(ctx: Any, input: Any) -> str:
        ctx.step("gen", str, 1, concurrency=Concurrency(key=KEY, limit=1))
        ctx.wait_for_signal("more")  # the run goes on, parked
        return "ok"

    engine.register("w", "1", body)
    first, second = engine.start("w", {}), engine.start("w", {})
    run_pending(engine, dispatcher)
    assert first.refresh().record.waiting_for == second.refresh().record.waiting_for == "signal:more"
    assert held(engine.store) == []


def test_cancelling_a_run_inside_its_step_hands_the_slot_on_at_once(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    seen: list[str] = []

    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")
            engine.cancel("a")
            seen.append(engine.get_run("b").status)  # handed the slot by the cancel, before a's body returns
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    run_pending(engine, dispatcher)
    assert seen == [RunStatus.PENDING]
    assert engine.get_run("a").status == RunStatus.CANCELLED
    assert engine.get_run("b").status == RunStatus.COMPLETED
    assert held(engine.store) == []


def test_a_late_hand_off_of_an_ended_run_leaves_the_slot_rows_of_its_retry(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    late: list[str] = []
    rows: list[list[tuple[str, int, str]]] = []
    release = engine.store.release_run_slots

    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")  # b waits for a's slot
            monkeypatch.setattr(engine.store, "release_run_slots", lambda run_id: late.append(run_id) or [])
            engine.cancel("b")  # the hand-off that follows its commit is late (a slow process)
            monkeypatch.setattr(engine.store, "release_run_slots", release)
            engine.retry("b")
            dispatcher.sent.remove("b")
            engine.execute("b")  # the retry waits for a's slot again
            assert late == ["b"]
            assert release("b") == []  # the cancel's hand-off comes now
            rows.append(held(engine.store))
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.clear()
    engine.execute("a")
    assert rows == [[("a", 0, "held"), ("b", 0, "waiting")]]  # the retry's row is left alone
    assert dispatcher.sent == ["b"]  # a's release handed it the slot
    run_pending(engine, dispatcher)
    assert engine.get_run("b").status == RunStatus.COMPLETED


def test_cancelling_a_waiting_run_drops_it_from_the_queue(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")
            engine.execute("c")
            engine.cancel("b")
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    for run_id in "abc":
        engine.start("w", {}, run_id=run_id)
    del dispatcher.sent[1:]
    run_pending(engine, dispatcher)
    assert [engine.get_run(r).status for r in "abc"] == [RunStatus.COMPLETED, RunStatus.CANCELLED, RunStatus.COMPLETED]


class _Crash(BaseException):
    """The worker dies inside the step (nothing after it runs, not even a finally's store call)."""


def test_a_takeover_frees_a_dead_executions_slot_once_and_the_next_waiter_runs(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[tuple[str, str]] = []
    crash = [True]

    def call(run_id: str) -> str:
        log.append(("in", run_id))
        if run_id == "a" and crash[0]:
            engine.execute("b")  # b waits for a's slot
            crash[0] = False
            raise _Crash
        log.append(("out", run_id))
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    give_back = WorkflowContext._give_slot
    monkeypatch.setattr(WorkflowContext, "_give_slot", lambda self, position, key: None)  # the process is gone
    with pytest.raises(_Crash):
        engine.execute(dispatcher.sent.pop(0))
    monkeypatch.setattr(WorkflowContext, "_give_slot", give_back)
    assert held(engine.store) == [("a", 0, "held"), ("b", 0, "waiting")]
    assert engine.get_run("a").status == RunStatus.RUNNING
    # Its heartbeat is old: a redelivery takes the run over.
    old = timezone.now() - timedelta(seconds=60)
    assert engine.store.transition("a", from_statuses=[RunStatus.RUNNING], to=RunStatus.RUNNING, heartbeat_at=old)
    engine.execute("a")
    # The takeover's replay freed the dead execution's slot and handed it to b,
    # then asked again behind it: a waits, b was sent.
    assert held(engine.store) == [("b", 0, "held"), ("a", 0, "waiting")]
    assert engine.get_run("a").record.waiting_for == f"slot:{KEY}"
    assert dispatcher.sent == ["b"]
    run_pending(engine, dispatcher)
    assert log == [("in", "a"), ("in", "b"), ("out", "b"), ("in", "a"), ("out", "a")]
    assert engine.get_run("a").status == engine.get_run("b").status == RunStatus.COMPLETED
    assert held(engine.store) == []


def test_a_limited_step_that_keeps_killing_its_worker_ends_dead_while_others_wait(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each takeover frees the dead execution's slot, hands it to the step waiting
    for it and parks behind it: the park takes back its own claim only, so the
    deaths add up and the run ends dead after MAX_ATTEMPTS, as without waiters."""
    crashes = [0]

    def call(run_id: str) -> str:
        if run_id == "a":
            crashes[0] += 1
            other = f"w{crashes[0]}"
            engine.start("w", {}, run_id=other)
            dispatcher.sent.remove(other)
            engine.execute(other)  # another run's step asks meanwhile: it waits for a's slot
            raise _Crash  # the body kills its worker every time
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    give_back = WorkflowContext._give_slot
    monkeypatch.setattr(WorkflowContext, "_give_slot", lambda self, p, k: None if self.run_id == "a" else give_back(self, p, k))
    engine.start("w", {}, run_id="a")
    max_attempts = int(durable_settings.MAX_ATTEMPTS)
    for _ in range(3 * max_attempts):
        while dispatcher.sent:
            with contextlib.suppress(_Crash):
                engine.execute(dispatcher.sent.pop(0))
        if engine.get_run("a").status != RunStatus.RUNNING:
            break
        # a's worker died inside the step: its heartbeat gets old, a redelivery takes it over.
        old = timezone.now() - timedelta(seconds=60)
        assert engine.store.transition("a", from_statuses=[RunStatus.RUNNING], to=RunStatus.RUNNING, heartbeat_at=old)
        dispatcher.sent.append("a")
    a = engine.get_run("a").record
    assert (a.status, crashes[0]) == (RunStatus.DEAD, max_attempts), f"a: {a.status}, attempt {a.attempt}, {crashes[0]} deaths"
    assert all(engine.get_run(f"w{n}").status == RunStatus.COMPLETED for n in range(1, crashes[0] + 1))
    assert held(engine.store) == []


def test_parking_for_a_slot_takes_back_its_own_claim_only(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    seen: list[int] = []

    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")
            seen.append(engine.get_run("b").record.attempt)
        return run_id

    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    # b died once before (its worker was killed before the step): its claim is its second.
    assert engine.store.transition("b", from_statuses=[RunStatus.PENDING], to=RunStatus.PENDING, attempt=1)
    run_pending(engine, dispatcher)
    assert seen == [1]  # claimed (2), parked (1): the earlier death still counts
    assert engine.get_run("b").status == RunStatus.COMPLETED


def handed_then_failed(engine: Engine, dispatcher: RecordingDispatcher, call: Any, broken: dict[str, bool]) -> None:
    """Register ``w`` (one step ``gen`` running ``call``, limit 1) and start a, b and c;
    a's step runs b inside its body, b parks, and a's release hands the slot to b, whose
    replay then raises before the step while ``broken["b"]`` (a bad deploy)."""

    def body(ctx: Any, input: Any) -> Any:
        if broken.get(ctx.run_id):
            raise RuntimeError("bug in the new deploy")
        return ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1))

    engine.register("w", "1", body)
    for run_id in "abc":
        engine.start("w", {}, run_id=run_id)
    dispatcher.sent.clear()
    engine.execute("a")
    assert dispatcher.sent == ["b"] and ("b", 0, "held") in held(engine.store)
    broken["b"] = True
    engine.execute(dispatcher.sent.pop(0))
    assert engine.get_run("b").status == RunStatus.FAILED


def test_a_run_that_fails_before_the_step_it_was_handed_a_slot_for_hands_it_on(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")
            engine.execute("c")  # b, then c, wait for a's slot
        return run_id

    handed_then_failed(engine, dispatcher, call, {})
    assert dispatcher.sent == ["c"]  # b's end handed its slot on at once, not at the next sweep
    assert held(engine.store) == [("c", 0, "held")]
    run_pending(engine, dispatcher)
    assert engine.get_run("c").status == RunStatus.COMPLETED


@pytest.mark.parametrize("release_lost", [False, True], ids=["released", "release-lost"])
def test_a_retried_run_does_not_take_up_a_slot_it_was_handed_before_it_failed(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch, release_lost: bool
) -> None:
    inside: list[str] = []
    peak = [0]
    broken: dict[str, bool] = {}

    def call(run_id: str) -> str:
        inside.append(run_id)
        peak[0] = max(peak[0], len(inside))
        if run_id == "a":
            engine.execute("b")  # b waits for a's slot
        if run_id == "c":  # c holds the only slot: b is retried (fixed) and executed meanwhile
            broken["b"] = False
            engine.retry("b")
            assert ("b", 0, "held") not in held(engine.store)
            dispatcher.sent.remove("b")
            engine.execute("b")
            assert engine.get_run("b").record.waiting_for == f"slot:{KEY}"
        inside.remove(run_id)
        return run_id

    if release_lost:  # b's end commits, the hand-off after it is lost: b's row stays, counting no more
        monkeypatch.setattr(engine.store, "release_run_slots", lambda run_id: [])
    handed_then_failed(engine, dispatcher, call, broken)
    monkeypatch.undo()
    engine.execute("c")  # c takes the slot b's end freed
    run_pending(engine, dispatcher)
    assert engine.get_run("c").status == engine.get_run("b").status == RunStatus.COMPLETED
    assert peak[0] == 1
    assert held(engine.store) == []


def test_a_run_ending_without_slot_rows_hands_no_step_slot_on(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    release = engine.store.release_run_slots
    monkeypatch.setattr(engine.store, "release_run_slots", lambda run_id: calls.append(run_id) or release(run_id))
    engine.register("w", "1", lambda ctx, input: ctx.step("gen", str, 1, concurrency=Concurrency(key=KEY, limit=1)))
    engine.register("plain", "1", lambda ctx, input: ctx.step("gen", str, 1))
    for name in ("w", "plain"):
        engine.start(name, {})
    run_pending(engine, dispatcher)
    assert calls == []  # the step gave its slot back itself: the finish has nothing to hand on


def test_the_sweeper_wakes_a_run_whose_wake_up_was_lost(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    limited(engine, nested={"a": "b"})
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    # The wake-up is lost after the hand-off committed: the store's own (DjangoStore's in
    # durable_release_slot on PostgreSQL) is left out, and the executor's never comes.
    store = engine.store
    monkeypatch.setattr(
        store, "release_slot_waking", lambda *args, **kwargs: BaseStore.release_slot_waking(store, *args, **kwargs)
    )
    monkeypatch.setattr(engine.executor, "slots_handed", lambda woken, started=(): None)
    run_pending(engine, dispatcher)
    assert engine.get_run("b").status == RunStatus.SUSPENDED and held(engine.store) == [("b", 0, "held")]
    monkeypatch.undo()
    assert engine.sweep()["slots"] == ["b"]
    assert engine.sweep()["slots"] == []  # woken once
    run_pending(engine, dispatcher)
    assert engine.get_run("b").status == RunStatus.COMPLETED


def test_the_sweeper_hands_on_a_slot_whose_release_was_lost(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    limited(engine, nested={"a": "b"})
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    # A crash after the journal write: the step's release is lost, and so is the finish's hand-off.
    monkeypatch.setattr(WorkflowContext, "_give_slot", lambda self, position, key: None)
    monkeypatch.setattr(engine.store, "release_run_slots", lambda run_id: [])
    run_pending(engine, dispatcher)
    monkeypatch.undo()
    # a's step is journaled, so its row no longer counts: the sweeper hands the slot to b.
    assert engine.get_run("a").status == RunStatus.COMPLETED
    assert engine.get_run("b").status == RunStatus.SUSPENDED
    assert engine.sweep()["slots"] == ["b"]
    run_pending(engine, dispatcher)
    assert engine.get_run("b").status == RunStatus.COMPLETED
    assert held(engine.store) == []


def test_an_operator_override_replaces_the_steps_limit(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    log = limited(engine, limit=1, nested={"a": "b"})
    engine.set_limit_override(KEY, 2, reason="a bigger contract")
    engine.start("w", {}, run_id="a")
    engine.start("w", {}, run_id="b")
    dispatcher.sent.remove("b")
    run_pending(engine, dispatcher)
    assert log == [("in", "a"), ("in", "b"), ("out", "b"), ("out", "a")]  # b ran inside a's step: 2 slots


def test_raising_the_override_hands_the_new_room_to_waiting_steps_at_once(
    engine: Engine, dispatcher: RecordingDispatcher
) -> None:
    woken: list[list[str]] = []

    def call(run_id: str) -> str:
        if run_id == "a":
            engine.execute("b")  # b and c wait for a's slot
            engine.execute("c")
            engine.set_limit_override(KEY, 2, reason="a bigger contract")
            woken.append(list(dispatcher.sent))
            rows.append(held(engine.store))
        return run_id

    rows: list[list[tuple[str, int, str]]] = []
    engine.register("w", "1", lambda ctx, input: ctx.step("gen", call, ctx.run_id, concurrency=Concurrency(key=KEY, limit=1)))
    for run_id in "abc":
        engine.start("w", {}, run_id=run_id)
    dispatcher.sent.clear()
    engine.execute("a")
    assert woken == [["b"]]  # one new slot: the oldest waiter got it, without waiting for the sweeper
    assert rows == [[("a", 0, "held"), ("b", 0, "held"), ("c", 0, "waiting")]]
    assert dispatcher.sent == ["b", "c"]  # then a's release handed its slot to c
    run_pending(engine, dispatcher)
    assert [engine.get_run(r).status for r in "abc"] == [RunStatus.COMPLETED] * 3


def test_the_sweeper_deletes_slot_rows_that_no_longer_count(
    engine: Engine, dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.register("w", "1", lambda ctx, input: ctx.step("gen", str, 1, concurrency=Concurrency(key=KEY, limit=1)))
    handle = engine.start("w", {})
    # A crash after the journal write: the step's release is lost, and so is the finish's hand-off.
    monkeypatch.setattr(WorkflowContext, "_give_slot", lambda self, position, key: None)
    monkeypatch.setattr(engine.store, "release_run_slots", lambda run_id: [])
    run_pending(engine, dispatcher)
    monkeypatch.undo()
    assert handle.refresh().status == RunStatus.COMPLETED
    assert held(engine.store) == [(handle.run_id, 0, "held")]  # journaled: it counts no more, but the row is left
    assert engine.sweep()["slots"] == []
    assert held(engine.store) == []
