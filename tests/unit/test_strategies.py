"""The Hatchet strategies (docs/how-to/strategies.md), several keys, CEL keys (docs/how-to/cel-keys.md)."""

from __future__ import annotations

from typing import Any

import pytest

from durable import (
    Concurrency,
    ConcurrencyLimitError,
    ConcurrencyQueueFullError,
    Engine,
    RunStatus,
    Strategy,
)
from durable.exceptions import ChildWorkflowError, InvalidStartError
from durable.runtime import Registry
from tests.unit.conftest import RecordingDispatcher

# Committed transactions: hand-offs run on commit, as in production.
pytestmark = pytest.mark.django_db(transaction=True)

GRR, CIP, NEWEST = Strategy.GROUP_ROUND_ROBIN, Strategy.CANCEL_IN_PROGRESS, Strategy.CANCEL_NEWEST


def tenant(input: dict[str, Any]) -> str:
    return f"tenant:{input['tenant']}"


def complete(engine: Engine, run_id: str) -> None:
    """Execute the run to completion, as a worker would."""
    engine.execute(run_id)
    assert engine.get_run(run_id).status == RunStatus.COMPLETED


def statuses(engine: Engine, handles: list[Any]) -> list[str]:
    return [h.refresh().status for h in handles]


# -- GROUP_ROUND_ROBIN ------------------------------------------------------------------


def test_grr_queues_over_limit_starts_holding_no_slot(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key=tenant, limit=2, strategy=GRR))
    runs = [engine.start("w", {"tenant": "a"}) for _ in range(4)]
    assert statuses(engine, runs) == ["pending", "pending", "queued", "queued"]
    assert dispatcher.sent == [runs[0].run_id, runs[1].run_id]  # queued runs are not sent
    assert engine.count_runs(tag="concurrency:tenant:a", statuses=["pending", "running", "suspended", "blocked"]) == 2


def test_grr_release_hands_the_slot_to_the_next_queued_run(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key=tenant, limit=1, strategy=GRR))
    first, second, third = (engine.start("w", {"tenant": "a"}) for _ in range(3))
    complete(engine, first.run_id)  # the release itself promotes, no sweep involved
    assert statuses(engine, [second, third]) == ["pending", "queued"]
    assert dispatcher.sent[-1] == second.run_id
    second.cancel()  # cancelling frees the slot as well
    assert third.refresh().status == "pending"
    assert dispatcher.sent[-1] == third.run_id


def test_grr_new_start_waits_behind_queued_runs(engine: Engine, dispatcher: RecordingDispatcher, store: Any) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key=tenant, limit=1, strategy=GRR))
    first, second = engine.start("w", {"tenant": "a"}), engine.start("w", {"tenant": "a"})
    # The slot frees without a hand-off (as if the promoting process died).
    assert store.transition(first.run_id, from_statuses=["pending"], to="completed")
    late = engine.start("w", {"tenant": "a"})
    # The newcomer queues and the oldest queued run gets the slot.
    assert statuses(engine, [second, late]) == ["pending", "queued"]


def test_grr_sweep_starts_queued_runs_whose_key_has_room(engine: Engine, store: Any) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key=tenant, limit=1, strategy=GRR))
    first, second = engine.start("w", {"tenant": "a"}), engine.start("w", {"tenant": "a"})
    assert store.transition(first.run_id, from_statuses=["pending"], to="failed")  # no hand-off
    assert engine.sweep()["promoted"] == [second.run_id]
    assert second.refresh().status == "pending"


def test_grr_max_queued_bounds_the_queue(engine: Engine) -> None:
    quota = Concurrency(key=tenant, limit=1, strategy=GRR, max_queued=2)
    engine.register("w", "1", lambda ctx, input: None, concurrency=quota)
    for _ in range(3):
        engine.start("w", {"tenant": "a"})
    with pytest.raises(ConcurrencyQueueFullError) as info:
        engine.start("w", {"tenant": "a"}, run_id="refused")
    error = info.value
    assert (error.key, error.limit, error.active, error.queued, error.max_queued) == ("tenant:a", 1, 1, 2, 2)
    assert isinstance(error, ConcurrencyLimitError) and error.code == "concurrency_queue_full"
    assert engine.store.get_run("refused") is None


def test_grr_hands_freed_capacity_round_robin_across_groups(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    quotas = [
        Concurrency(key=tenant, limit=100, strategy=GRR),
        Concurrency(expression="'global'", limit=2, strategy=GRR),
    ]
    engine.register("w", "1", lambda ctx, input: None, concurrency=quotas)
    # Tenant a floods first, then b, then c: 30 queued runs each behind 2 running.
    running = [engine.start("w", {"tenant": "a"}) for _ in range(2)]
    for name in "abc":
        for _ in range(30):
            engine.start("w", {"tenant": name})
    for handle in running:
        complete(engine, handle.run_id)
    # Complete runs in the order they were handed a slot; note their tenants.
    order: list[str] = []
    while pending := engine.list_runs(statuses=["pending"]):
        handle = min(pending, key=lambda h: dispatcher.sent.index(h.run_id))
        order.append(handle.input["tenant"])
        complete(engine, handle.run_id)
    assert len(order) == 90
    # Freed slots went a, b, c, a, b, c... not 30 times a first.
    assert order[:9] in (list("abcabcabc"), list("bcabcabca"), list("cabcabcab"))
    assert order.count("a") == order.count("b") == order.count("c") == 30


def test_grr_several_keys_wait_holding_no_slot_of_any_key(engine: Engine) -> None:
    quotas = [Concurrency(key=tenant, limit=1, strategy=GRR), Concurrency(key="global", limit=2, strategy=GRR)]
    engine.register("w", "1", lambda ctx, input: None, concurrency=quotas)
    a1 = engine.start("w", {"tenant": "a"})
    a2 = engine.start("w", {"tenant": "a"})  # tenant:a full: queued, takes no global slot
    b1 = engine.start("w", {"tenant": "b"})  # global still has room for b
    assert statuses(engine, [a1, a2, b1]) == ["pending", "queued", "pending"]
    complete(engine, b1.run_id)  # a global slot frees, but tenant:a is still full
    assert a2.refresh().status == "queued"
    complete(engine, a1.run_id)
    assert a2.refresh().status == "pending"


def test_grr_promoter_reads_the_queue_again_when_its_head_was_taken(
    engine: Engine, store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two releases race on a key of limit 2: A's promoter counts B in flight and
    hands its one slot to q1; B's release commits after that count, and its
    promoter had read the queue before q1 was started. That head is gone: it reads
    the queue again and hands B's slot to q2, which would otherwise wait."""
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key=tenant, limit=2, strategy=GRR))
    a, b, q1, q2 = (engine.start("w", {"tenant": "a"}) for _ in range(4))
    stale = store.queued_heads("concurrency:tenant:a")  # B's promoter reads the queue early
    assert [run_id for _, run_id in stale] == [q1.run_id]
    assert store.transition(a.run_id, from_statuses=["pending"], to="completed")
    assert engine.promoter.promote(["tenant:a"]) == [q1.run_id]  # A's release: its one slot
    assert store.transition(b.run_id, from_statuses=["pending"], to="completed")
    reads = [stale]
    real = store.queued_heads

    def queued_heads(tag: str, **kwargs: Any) -> list[tuple[str, str]]:
        return reads.pop() if reads else real(tag, **kwargs)

    monkeypatch.setattr(store, "queued_heads", queued_heads)
    assert engine.promoter.promote(["tenant:a"]) == [q2.run_id]  # B's release, with the stale head
    assert statuses(engine, [q1, q2]) == ["pending", "pending"]


# -- CANCEL_IN_PROGRESS -----------------------------------------------------------------


def test_cancel_in_progress_cancels_the_oldest_and_starts_at_once(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key=tenant, limit=2, strategy=CIP))
    old, mid = engine.start("w", {"tenant": "a"}), engine.start("w", {"tenant": "a"})
    new = engine.start("w", {"tenant": "a"})
    assert statuses(engine, [old, mid, new]) == ["cancelled", "pending", "pending"]
    assert dispatcher.revoked == [old.run_id]
    assert dispatcher.sent[-1] == new.run_id
    assert "CANCEL_IN_PROGRESS" in old.error["message"]
    engine.execute(old.run_id)  # its message, if still delivered, changes nothing
    assert old.refresh().status == "cancelled"


def test_cancel_in_progress_stops_a_running_victim_at_its_next_step(engine: Engine) -> None:
    calls: list[str] = []

    def body(ctx: Any, input: Any) -> None:
        ctx.step("first", calls.append, "first")
        if input.get("supersede"):
            engine.start("w", {"tenant": "a"})  # a newer run arrives while this one runs
        ctx.step("second", calls.append, "second")

    engine.register("w", "1", body, concurrency=Concurrency(key=tenant, limit=1, strategy=CIP))
    victim = engine.start("w", {"tenant": "a", "supersede": True})
    engine.execute(victim.run_id)
    assert calls == ["first"]
    assert victim.refresh().status == "cancelled"


# -- CANCEL_NEWEST ------------------------------------------------------------------------


def test_cancel_newest_creates_the_new_run_cancelled(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key=tenant, limit=1, strategy=NEWEST))
    running = engine.start("w", {"tenant": "a"})
    newest = engine.start("w", {"tenant": "a"})
    assert newest.created and newest.status == "cancelled"
    assert "CANCEL_NEWEST" in newest.error["message"]
    assert running.refresh().status == "pending"
    assert dispatcher.sent == [running.run_id]
    assert {h.run_id for h in engine.list_runs(statuses=["cancelled"])} == {newest.run_id}


# -- several keys, limits, CEL --------------------------------------------------------------


def test_reject_with_several_keys_names_the_full_key(engine: Engine) -> None:
    quotas = [Concurrency(key=tenant, limit=5), Concurrency(key="global", limit=1, strategy=GRR)]
    engine.register("w", "1", lambda ctx, input: None, concurrency=quotas)
    engine.start("w", {"tenant": "a"})
    assert engine.start("w", {"tenant": "a"}).status == "queued"  # global is full: it waits
    engine.register("w", "1", lambda ctx, input: None, concurrency=[Concurrency(key=tenant, limit=1), quotas[1]])
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("w", {"tenant": "a"})
    assert info.value.key == "tenant:a"


@pytest.mark.parametrize("strategy", list(Strategy))
def test_limit_zero_rejects_with_every_strategy(engine: Engine, strategy: Strategy) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key="k", limit=0, strategy=strategy))
    with pytest.raises(ConcurrencyLimitError):
        engine.start("w", {})
    assert engine.count_runs() == 0


def test_cel_expression_key(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(expression="input.group", limit=1))
    handle = engine.start("w", {"group": "blue"})
    assert handle.record.tags == ["concurrency:blue"]
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("w", {"group": "blue"})
    assert info.value.key == "blue"
    engine.start("w", {"group": "green"})


def test_cel_constant_expression_is_one_global_limit(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(expression="'global'", limit=1))
    engine.start("w", {"group": "blue"})
    with pytest.raises(ConcurrencyLimitError):
        engine.start("w", {"group": "green"})


def test_cel_null_leaves_the_start_unlimited(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(expression="input.group", limit=1))
    for _ in range(3):
        assert engine.start("w", {"group": None}).record.tags == []


@pytest.mark.parametrize("input, message", [({"group": 7}, "must give a string or None, got 7"), ({}, "raised KeyError")])
def test_cel_non_string_or_missing_field_is_refused(engine: Engine, input: Any, message: str) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(expression="input.group", limit=1))
    with pytest.raises(InvalidStartError, match=message):
        engine.start("w", input)
    assert engine.count_runs() == 0


# -- issue 8: the strategies' corner cases ------------------------------------------------------

LIFETIME = ("pending", "running", "suspended", "blocked", "completed")


def test_cancel_in_progress_never_picks_a_finished_run_of_a_lifetime_cap(engine: Engine, store: Any) -> None:
    quota = Concurrency(key="cap", limit=2, count_statuses=LIFETIME, strategy=CIP)
    engine.register("w", "1", lambda ctx, input: None, concurrency=quota)
    done = engine.start("w", {})
    assert store.transition(done.run_id, from_statuses=["pending"], to="completed")
    waiting = engine.start("w", {})
    new = engine.start("w", {})
    # The completed run cannot be cancelled: the pending one makes room.
    assert statuses(engine, [done, waiting, new]) == ["completed", "cancelled", "pending"]
    assert engine.count_runs(tag="concurrency:cap", statuses=LIFETIME) == 2


def test_cancel_in_progress_refuses_when_cancelling_cannot_make_room(engine: Engine) -> None:
    counted = ("pending", "running", "suspended", "blocked", "cancelled")  # a cancelled run still counts
    engine.register("w", "1", lambda ctx, input: None, Concurrency(key="k", limit=2, count_statuses=counted, strategy=CIP))
    first, second = engine.start("w", {}), engine.start("w", {})
    with pytest.raises(ConcurrencyLimitError, match="cannot make room"):
        engine.start("w", {}, run_id="refused")
    assert statuses(engine, [first, second]) == ["pending", "pending"]  # nothing was cancelled
    assert engine.store.get_run("refused") is None


def _parent_and_child(engine: Engine, child_quota: Concurrency, parent_quota: Concurrency) -> None:
    def parent(ctx: Any, input: Any) -> Any:
        try:
            return {"child": ctx.child("child", {})}
        except ChildWorkflowError as exc:
            return {"refused": type(exc.__cause__).__name__, "message": str(exc)}

    engine.register("child", "1", lambda ctx, input: "done", child_quota)
    engine.register("parent", "1", parent, parent_quota)


def test_cancel_in_progress_child_never_cancels_its_parent(engine: Engine) -> None:
    quota = Concurrency(key="k", limit=1, strategy=CIP)
    _parent_and_child(engine, quota, quota)
    parent = engine.start("parent", {})
    engine.execute(parent.run_id)
    # The parent holds the only slot and is no candidate: the child is refused, the parent told.
    assert parent.refresh().status == "completed"
    assert parent.output["refused"] == "ConcurrencyLimitError"
    assert engine.list_runs(workflow="child") == []


def test_cancel_in_progress_child_cancels_another_run_not_its_parent(engine: Engine) -> None:
    quota = Concurrency(key="k", limit=2, strategy=CIP)
    _parent_and_child(engine, quota, quota)
    parent = engine.start("parent", {})
    other = engine.start("child", {})  # a run of the key, older than the child, not an ancestor
    engine.execute(parent.run_id)
    assert other.refresh().status == "cancelled"
    assert parent.refresh().status == "suspended"
    (child,) = [h for h in engine.list_runs(workflow="child") if h.run_id != other.run_id]
    assert child.status == "pending"


def test_round_robin_child_on_its_parents_full_key_is_refused_not_queued(engine: Engine) -> None:
    quota = Concurrency(key="k", limit=1, strategy=GRR)
    _parent_and_child(engine, quota, quota)
    parent = engine.start("parent", {})
    engine.execute(parent.run_id)
    # Queued behind its own suspended parent, the child would wait forever: refused at once.
    assert parent.refresh().status == "completed"
    assert parent.output["refused"] == "ConcurrencyLimitError"
    assert "holds a slot of this key" in parent.output["message"]
    assert engine.list_runs(workflow="child") == []


def test_round_robin_child_queues_when_its_waiting_parent_frees_its_slot(engine: Engine) -> None:
    # "suspended" not counted: the parent frees its slot while it waits, the child gets it.
    quota = Concurrency(key="k", limit=1, count_statuses=("pending", "running", "blocked"), strategy=GRR)
    _parent_and_child(engine, quota, quota)
    parent = engine.start("parent", {})
    engine.execute(parent.run_id)
    assert parent.refresh().status == "suspended"
    (child,) = engine.list_runs(workflow="child")
    assert child.status == "pending"  # queued, then handed the slot its parent freed
    complete(engine, child.run_id)
    engine.execute(parent.run_id)
    assert parent.refresh().output == {"child": "done"}


def test_round_robin_direct_admission_moves_the_cursor(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    quotas = [Concurrency(key=tenant, limit=100, strategy=GRR), Concurrency(key="global", limit=1, strategy=GRR)]
    engine.register("w", "1", lambda ctx, input: None, concurrency=quotas)
    a1 = engine.start("w", {"tenant": "a"})  # admitted directly
    a2, a3, b1 = (engine.start("w", {"tenant": t}) for t in "aab")
    assert statuses(engine, [a1, a2, a3, b1]) == ["pending", "queued", "queued", "queued"]
    complete(engine, a1.run_id)
    # Tenant a was served last: the freed slot goes to b.
    assert statuses(engine, [a2, a3, b1]) == ["queued", "queued", "pending"]


@pytest.mark.parametrize("strategy", [GRR, CIP, NEWEST])
def test_a_full_lifetime_cap_rejects_with_every_strategy(engine: Engine, store: Any, strategy: Strategy) -> None:
    engine.register(
        "w", "1", lambda ctx, input: None, Concurrency(key="cap", limit=1, count_statuses=LIFETIME, strategy=strategy)
    )
    done = engine.start("w", {})
    assert store.transition(done.run_id, from_statuses=["pending"], to="completed")
    # Its finished runs alone fill the cap: no run could ever make room, as with limit <= 0.
    with pytest.raises(ConcurrencyLimitError, match="lifetime cap") as info:
        engine.start("w", {}, run_id="never")
    assert not isinstance(info.value, ConcurrencyQueueFullError)
    assert engine.store.get_run("never") is None


def test_a_child_counts_in_its_parents_namespace_with_its_parents_fencing(store: Any, dispatcher: RecordingDispatcher) -> None:
    registry = Registry()
    t1 = Engine(store, namespace="t1", scope_reads=True, dispatch=dispatcher, registry=registry)
    t2 = Engine(store, namespace="t2", scope_reads=True, dispatch=dispatcher, registry=registry)
    worker = Engine(store, scope_reads=False, dispatch=dispatcher, registry=registry)  # as the docs recommend
    _parent_and_child(t1, Concurrency(key="k", limit=1), Concurrency(key="p", limit=5))
    t2.start("child", {})  # tenant t2's run of key k
    assert t1.start("child", {}, run_id="direct").created  # fenced: t2's run is not counted
    t1.cancel("direct")
    parent = t1.start("parent", {})
    worker.execute(parent.run_id)
    (child,) = t1.list_runs(workflow="child", statuses=["pending"])
    assert (child.namespace, child.record.parent_run_id) == ("t1", parent.run_id)
    assert parent.refresh().status == "suspended"
