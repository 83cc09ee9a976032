"""The queue-depth strategies CANCEL_QUEUED_EXCEPT_NEWEST / _OLDEST (docs/how-to/queue-depth.md),
on every store: PostgreSQL or SQLite (DjangoStore, per DATABASE_URL) and the in-memory store."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable import Concurrency, ConcurrencyLimitError, ConcurrencyQueueFullError, Engine, RunStatus, Strategy
from durable.exceptions import ChildWorkflowError, InvalidStartError
from tests.unit.conftest import RecordingDispatcher

# Committed transactions: hand-offs run on commit, as in production.
pytestmark = pytest.mark.django_db(transaction=True)

NEWEST, OLDEST = Strategy.CANCEL_QUEUED_EXCEPT_NEWEST, Strategy.CANCEL_QUEUED_EXCEPT_OLDEST
GRR = Strategy.GROUP_ROUND_ROBIN


def doc(input: dict[str, Any]) -> str:
    return f"doc:{input['doc']}"


def complete(engine: Engine, run_id: str) -> None:
    engine.execute(run_id)
    assert engine.get_run(run_id).status == RunStatus.COMPLETED


def statuses(handles: list[Any]) -> list[str]:
    return [h.refresh().status for h in handles]


def register(engine: Engine, strategy: Strategy, *, limit: int = 1, **options: Any) -> None:
    quota = Concurrency(key=doc, limit=limit, strategy=strategy, **options)
    engine.register("preview", "1", lambda ctx, input: input["n"], concurrency=quota)


def start(engine: Engine, n: int, **kwargs: Any) -> Any:
    return engine.start("preview", {"doc": "d1", "n": n}, **kwargs)


# -- declaring ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [NEWEST, OLDEST])
def test_max_queued_defaults_to_one(strategy: Strategy) -> None:
    assert Concurrency(key="k", strategy=strategy).max_queued == 1
    assert Concurrency(key="k", strategy=strategy, max_queued=3).max_queued == 3


@pytest.mark.parametrize("strategy", [NEWEST, OLDEST])
@pytest.mark.parametrize("max_queued", [0, -1, True, 1.5, "2"])
def test_max_queued_must_be_a_positive_integer(strategy: Strategy, max_queued: Any) -> None:
    with pytest.raises(InvalidStartError, match="queue depth of Strategy.CANCEL_QUEUED_EXCEPT_.*use Strategy.CANCEL_NEWEST"):
        Concurrency(key="k", strategy=strategy, max_queued=max_queued)


def test_the_strategies_by_value() -> None:
    assert Strategy("cancel_queued_except_newest") is NEWEST
    assert Strategy("cancel_queued_except_oldest") is OLDEST
    assert Concurrency(key="k", strategy="cancel_queued_except_newest").strategy is NEWEST  # type: ignore[arg-type]


# -- CANCEL_QUEUED_EXCEPT_NEWEST -----------------------------------------------------------


def test_except_newest_a_b_c(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    """Hatchet's A, B, C with max_runs=1: A runs, B waits, C replaces B, C runs after A."""
    register(engine, NEWEST)
    a, b = start(engine, 1), start(engine, 2)
    assert statuses([a, b]) == ["pending", "queued"]
    c = start(engine, 3)
    assert statuses([a, b, c]) == ["pending", "cancelled", "queued"]
    assert b.record.error == {
        "type": "durable.cancel_queued_except_newest",
        "message": f"Cancelled while queued: run {c.run_id!r} replaced it in the queue of concurrency key doc:d1 "
        "(CANCEL_QUEUED_EXCEPT_NEWEST).",
        "key": "doc:d1",
        "replaced_by": c.run_id,
    }
    assert b.record.finished_at is not None
    assert dispatcher.sent == [a.run_id]  # neither queued run was sent
    complete(engine, a.run_id)  # the release hands the slot to C
    assert c.refresh().status == "pending" and dispatcher.sent[-1] == c.run_id
    complete(engine, c.run_id)
    assert c.refresh().output == 3


def test_except_newest_keeps_the_newest_max_queued_in_arrival_order(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    register(engine, NEWEST, limit=2, max_queued=3)
    runs = [start(engine, n) for n in range(10)]
    # Two run, the last three wait, the five between were each replaced by a newer one.
    assert statuses(runs) == ["pending"] * 2 + ["cancelled"] * 5 + ["queued"] * 3
    replaced_by = [r.record.error["replaced_by"] for r in runs[2:7]]
    assert replaced_by == [runs[n].run_id for n in range(5, 10)]  # each by the start that found the queue full
    assert engine.count_runs(tag="concurrency:doc:d1", statuses=["queued"]) == 3
    complete(engine, runs[0].run_id)
    complete(engine, runs[1].run_id)
    assert statuses(runs[7:]) == ["pending", "pending", "queued"]  # oldest queued first
    assert dispatcher.sent[-2:] == [runs[7].run_id, runs[8].run_id]


def test_except_newest_starts_at_once_while_the_key_has_room(engine: Engine) -> None:
    register(engine, NEWEST, limit=2)
    runs = [start(engine, n) for n in range(2)]
    assert statuses(runs) == ["pending", "pending"]
    assert all(r.record.error is None for r in runs)


def test_except_newest_new_start_waits_behind_queued_runs(engine: Engine, store: Any) -> None:
    """A slot freed without a hand-off (its promoter died): the newcomer replaces the
    queued run and gets the slot by the hand-off its own queueing makes."""
    register(engine, NEWEST)
    a, b = start(engine, 1), start(engine, 2)
    assert store.transition(a.run_id, from_statuses=["pending"], to="completed")
    c = start(engine, 3)
    assert statuses([b, c]) == ["cancelled", "pending"]


def test_except_newest_user_cancel_of_a_queued_run_frees_its_place(engine: Engine) -> None:
    register(engine, NEWEST)
    a, b = start(engine, 1), start(engine, 2)
    b.cancel()
    assert b.record.error["type"] == "durable.cancelled"
    c = start(engine, 3)
    assert statuses([a, b, c]) == ["pending", "cancelled", "queued"]
    assert "replaced_by" not in b.refresh().record.error  # nobody replaced it: it was cancelled by hand


def test_except_newest_sends_run_finished_for_the_replaced_run(engine: Engine) -> None:
    from durable import signals

    seen: list[tuple[str, str]] = []

    def on_finished(sender: Any, run_id: str, status: str, **kwargs: Any) -> None:
        seen.append((run_id, status))

    register(engine, NEWEST)
    signals.run_finished.connect(on_finished, sender=engine)
    try:
        start(engine, 1)
        b = start(engine, 2)
        start(engine, 3)
    finally:
        signals.run_finished.disconnect(on_finished, sender=engine)
    assert seen == [(b.run_id, "cancelled")]


# -- CANCEL_QUEUED_EXCEPT_OLDEST -----------------------------------------------------------


def test_except_oldest_a_b_c(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    """Hatchet's A, B, C with max_runs=1: A runs, B waits, C is cancelled, B runs after A."""
    register(engine, OLDEST)
    a, b = start(engine, 1), start(engine, 2)
    c = start(engine, 3, run_id="c")
    assert c.created and c.status == "cancelled"
    assert statuses([a, b, c]) == ["pending", "queued", "cancelled"]
    assert c.record.error == {
        "type": "durable.cancel_queued_except_oldest",
        "message": "Cancelled at start: the queue of concurrency key doc:d1 was full (1 of max_queued=1 waiting, "
        "1 of 1 in flight); CANCEL_QUEUED_EXCEPT_OLDEST keeps the runs queued first.",
        "key": "doc:d1",
    }
    assert c.record.finished_at is not None
    assert dispatcher.sent == [a.run_id]
    complete(engine, a.run_id)
    assert b.refresh().status == "pending" and dispatcher.sent[-1] == b.run_id


def test_except_oldest_keeps_the_first_max_queued(engine: Engine) -> None:
    register(engine, OLDEST, limit=1, max_queued=2)
    runs = [start(engine, n) for n in range(6)]
    assert statuses(runs) == ["pending", "queued", "queued", "cancelled", "cancelled", "cancelled"]
    complete(engine, runs[0].run_id)
    assert statuses(runs[1:3]) == ["pending", "queued"]
    assert start(engine, 9).status == "queued"  # a place freed in the queue


def test_an_idempotent_restart_returns_the_cancelled_run(engine: Engine) -> None:
    register(engine, OLDEST)
    start(engine, 1), start(engine, 2)
    first = start(engine, 3, run_id="late")
    again = start(engine, 3, run_id="late")
    assert (again.created, again.status, again.run_id) == (False, "cancelled", first.run_id)


# -- runs coming back from a sleep ---------------------------------------------------------


@pytest.mark.parametrize("strategy", [NEWEST, OLDEST])
@pytest.mark.parametrize("statuses", [["pending", "running"], ["pending", "running", "suspended"], ["running", "blocked"]])
def test_a_queue_depth_key_counts_the_statuses_a_run_comes_back_from(strategy: Strategy, statuses: list[str]) -> None:
    """A run waking onto a full key that did not count its sleep would be queued
    behind runs that never started, and a newer start would cancel it as replaced."""
    with pytest.raises(InvalidStartError, match=f"Strategy.{strategy.name} needs every key of the start to count"):
        Concurrency(key="k", strategy=strategy, count_statuses=statuses)


def test_every_key_of_a_queue_depth_start_counts_them(engine: Engine) -> None:
    narrow = Concurrency(key="global", limit=1, strategy=GRR, count_statuses=["pending", "running"])
    engine.register("preview", "1", lambda ctx, input: None, concurrency=[Concurrency(key=doc, strategy=NEWEST), narrow])
    with pytest.raises(InvalidStartError, match="its key 'global' counts \\['pending', 'running'\\]"):
        start(engine, 1)
    assert engine.count_runs() == 0  # nothing created


def test_a_run_waking_from_a_sleep_is_never_queued_nor_replaced(engine: Engine, store: Any) -> None:
    register(engine, NEWEST)
    sleeper = start(engine, 1)
    # It executes, then sleeps: suspended, it keeps its slot (the default statuses count it).
    assert store.transition(
        sleeper.run_id,
        from_statuses=["pending"],
        to="suspended",
        waiting_for="sleep",
        wake_at=timezone.now() - timedelta(seconds=1),
    )
    waiting = start(engine, 2)
    assert waiting.status == "queued"
    assert engine.executor.wake_due(sleeper.run_id)
    assert sleeper.refresh().status == "pending"  # back to work, not behind the queue
    newer = start(engine, 3)
    assert statuses([sleeper, waiting, newer]) == ["pending", "cancelled", "queued"]
    assert waiting.record.error["replaced_by"] == newer.run_id


# -- with other keys and strategies --------------------------------------------------------


def test_would_admit_tells_what_a_start_would_do(engine: Engine) -> None:
    register(engine, NEWEST)
    a, b = start(engine, 1), start(engine, 2)
    check = engine.would_admit("preview", {"doc": "d1", "n": 3})
    assert (check.admitted, check.outcome, check.key) == (False, "queue", "doc:d1")
    assert b.run_id in check.detail and "CANCEL_QUEUED_EXCEPT_NEWEST" in check.detail
    assert check.keys[0].queued == 1 and check.keys[0].max_queued == 1
    assert statuses([a, b]) == ["pending", "queued"]  # nothing changed
    oldest = engine.would_admit("preview", {"doc": "d1", "n": 3}, concurrency=Concurrency(key="doc:d1", limit=1, strategy=OLDEST))
    assert (oldest.admitted, oldest.outcome) == (False, "cancel_newest")


def test_reject_on_another_full_key_wins(engine: Engine) -> None:
    quotas = [Concurrency(key=doc, limit=1, strategy=NEWEST), Concurrency(key="global", limit=1)]
    engine.register("preview", "1", lambda ctx, input: None, concurrency=quotas)
    a = start(engine, 1)
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, 2)
    assert info.value.key == "global"
    assert statuses([a]) == ["pending"]


def test_except_oldest_full_queue_wins_over_queueing_on_another_key(engine: Engine) -> None:
    quotas = [Concurrency(key=doc, limit=1, strategy=OLDEST), Concurrency(key="global", limit=5, strategy=GRR, max_queued=0)]
    engine.register("preview", "1", lambda ctx, input: None, concurrency=quotas)
    start(engine, 1), start(engine, 2)
    # The queue of doc:d1 is full: created cancelled, before "global"'s max_queued=0 could refuse it.
    assert start(engine, 3).status == "cancelled"


def test_round_robin_queue_full_cancels_nothing(engine: Engine) -> None:
    quotas = [Concurrency(key=doc, limit=1, strategy=NEWEST), Concurrency(key="global", limit=1, strategy=GRR, max_queued=1)]
    engine.register("preview", "1", lambda ctx, input: None, concurrency=quotas)
    a, b = start(engine, 1), start(engine, 2)
    with pytest.raises(ConcurrencyQueueFullError) as info:
        start(engine, 3)
    assert info.value.key == "global"
    assert statuses([a, b]) == ["pending", "queued"]  # the queued run was not replaced


def test_queued_behind_another_key_counts_in_the_queue(engine: Engine) -> None:
    """A run queued because another key is full is in this key's queue too: the
    queue depth is the key's queued runs, whatever made them wait."""
    engine.register(
        "preview",
        "1",
        lambda ctx, input: None,
        concurrency=[Concurrency(key=doc, limit=5, strategy=NEWEST), Concurrency(key="global", limit=1, strategy=GRR)],
    )
    a, b, c = start(engine, 1), start(engine, 2), start(engine, 3)
    assert statuses([a, b, c]) == ["pending", "cancelled", "queued"]
    assert b.record.error["replaced_by"] == c.run_id


def test_limit_zero_rejects(engine: Engine) -> None:
    register(engine, NEWEST, limit=0)
    with pytest.raises(ConcurrencyLimitError):
        start(engine, 1)
    assert engine.count_runs() == 0


@pytest.mark.parametrize("strategy", [NEWEST, OLDEST])
def test_child_on_its_parents_full_key_is_refused_not_queued(engine: Engine, strategy: Strategy) -> None:
    quota = Concurrency(key="tree", limit=1, strategy=strategy)

    def parent(ctx: Any, input: Any) -> Any:
        try:
            return {"child": ctx.child("child", {})}
        except ChildWorkflowError as exc:
            return {"refused": type(exc.__cause__).__name__, "message": str(exc)}

    engine.register("parent", "1", parent, concurrency=quota)
    engine.register("child", "1", lambda ctx, input: "done", concurrency=quota)
    handle = engine.start("parent", {})
    engine.execute(handle.run_id)
    # Queued behind its own suspended parent, the child would wait forever: refused at once.
    assert handle.refresh().status == "completed"
    assert handle.output["refused"] == "ConcurrencyLimitError"
    assert "holds a slot of this key" in handle.output["message"]
    assert engine.list_runs(workflow="child") == []
