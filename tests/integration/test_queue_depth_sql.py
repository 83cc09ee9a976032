"""``durable_admit_queued`` decides CANCEL_QUEUED_EXCEPT_NEWEST / _OLDEST as the generic
path does: the same starts through PostgreSQL's function and through the in-memory
store give the same statuses, the same errors (messages included) and the same
replaced runs (see test_queue_sql for the harness)."""

from __future__ import annotations

from typing import Any

import pytest

from durable import Concurrency, Engine, Strategy
from tests.integration.test_queue_sql import _both, _start

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

NEWEST, OLDEST = Strategy.CANCEL_QUEUED_EXCEPT_NEWEST, Strategy.CANCEL_QUEUED_EXCEPT_OLDEST
GRR = Strategy.GROUP_ROUND_ROBIN


def _runs(engine: Engine, key: str) -> list[Any]:
    """Every run of ``key`` in creation order: its status, and its error with run ids
    replaced by their position (ids differ between the two engines)."""
    runs = sorted(engine.list_runs(tag=f"concurrency:{key}"), key=lambda h: (h.record.created_at, h.run_id))
    position = {h.run_id: f"#{i}" for i, h in enumerate(runs)}
    described = []
    for handle in runs:
        error = dict(handle.error or {})
        for id_, name in position.items():
            error = {k: v.replace(repr(id_), name).replace(id_, name) if isinstance(v, str) else v for k, v in error.items()}
        described.append((handle.status, error, handle.record.finished_at is not None))
    return described


def test_except_newest_replaces_the_oldest_queued_runs() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        quota = Concurrency(key=key, limit=1, strategy=NEWEST, max_queued=2)
        return [*(_start(engine, quota) for _ in range(6)), _runs(engine, key)]

    outcome = _both(scenario)
    assert outcome[:6] == ["pending", "queued", "queued", "queued", "queued", "queued"]
    assert [status for status, _, _ in outcome[6]] == ["pending", "cancelled", "cancelled", "cancelled", "queued", "queued"]
    assert [error.get("replaced_by") for _, error, _ in outcome[6][1:4]] == ["#3", "#4", "#5"]


def test_except_oldest_creates_the_newcomer_cancelled() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        quota = Concurrency(key=key, limit=1, strategy=OLDEST, max_queued=2)
        return [*(_start(engine, quota) for _ in range(5)), _runs(engine, key)]

    outcome = _both(scenario)
    assert outcome[:5] == ["pending", "queued", "queued", "cancelled", "cancelled"]
    assert outcome[5][3] == (
        "cancelled",
        {
            "type": "durable.cancel_queued_except_oldest",
            "message": f"Cancelled at start: the queue of concurrency key {outcome[5][3][1]['key']} was full "
            "(2 of max_queued=2 waiting, 1 of 1 in flight); CANCEL_QUEUED_EXCEPT_OLDEST keeps the runs queued first.",
            "key": outcome[5][3][1]["key"],
        },
        True,
    )


def test_precedence_with_round_robin_keys() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        other = key + ":rr"
        oldest = [Concurrency(key=key, limit=1, strategy=OLDEST), Concurrency(key=other, limit=5, strategy=GRR, max_queued=0)]
        newest = [Concurrency(key=key, limit=1, strategy=NEWEST), Concurrency(key=other, limit=5, strategy=GRR, max_queued=1)]
        return [
            _start(engine, *oldest),  # room
            _start(engine, *oldest),  # queued: the round-robin key is not full, its queue is empty
            _start(engine, *oldest),  # the queue of `key` is full: cancelled, before max_queued=0 refuses
            _start(engine, *newest),  # the round-robin queue holds 1 = max_queued: refused, nothing replaced
            _runs(engine, key),
        ]

    outcome = _both(scenario)
    assert outcome[:3] == ["pending", "queued", "cancelled"]
    assert outcome[3][0] == "ConcurrencyQueueFullError"
    assert [status for status, _, _ in outcome[4]] == ["pending", "queued", "cancelled"]


def test_a_queued_run_waiting_for_another_key_is_replaced_too() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        quotas = [Concurrency(key=key, limit=5, strategy=NEWEST), Concurrency(key=key + ":g", limit=1, strategy=GRR)]
        return [*(_start(engine, *quotas) for _ in range(3)), _runs(engine, key)]

    outcome = _both(scenario)
    assert outcome[:3] == ["pending", "queued", "queued"]
    assert [status for status, _, _ in outcome[3]] == ["pending", "cancelled", "queued"]


def test_a_limit_of_zero_and_a_child_behind_its_parent_are_refused() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        zero = Concurrency(key=key + ":0", limit=0, strategy=NEWEST)
        quota = Concurrency(key=key, limit=1, strategy=OLDEST)
        parent = engine.start("w", {}, run_id=f"parent-{key}", concurrency=quota)  # holds the slot, as a suspended parent would
        return [_start(engine, zero), _start(engine, quota, parent=parent.run_id), _runs(engine, key)]

    outcome = _both(scenario)
    assert outcome[0][0] == "ConcurrencyLimitError"
    assert outcome[1][0] == "ConcurrencyLimitError" and "holds a slot of this key" in outcome[1][1]
    assert [status for status, _, _ in outcome[2]] == ["pending"]
