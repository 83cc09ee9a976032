"""``durable_admit_queued`` and ``durable_promote`` decide as the generic path does:
the same starts, through PostgreSQL's functions and through the in-memory store
(``Engine._admit``, ``admission.decide``, ``Promoter``), give the same statuses,
the same errors with the same fields and messages, and the same hand-offs."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from durable import Concurrency, DurableError, Engine, InMemoryStore, RunStatus, Strategy
from durable.models import ConcurrencyLock
from durable.runtime import Registry

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

GRR = Strategy.GROUP_ROUND_ROBIN


def _engines() -> tuple[Engine, Engine]:
    engines = []
    for store in (None, InMemoryStore()):
        registry = Registry()
        registry.register("w", "1", lambda ctx, input: None)
        engines.append(Engine(store, dispatch=lambda engine, run: None, registry=registry))
    return engines[0], engines[1]


def _outcome(call: Callable[[], Any]) -> Any:
    """A start's status, or its error: class, message and fields."""
    try:
        return call().status
    except DurableError as exc:
        return type(exc).__name__, str(exc), exc.fields


def _both(scenario: Callable[[Engine, str], list[Any]]) -> list[Any]:
    """Run ``scenario`` on PostgreSQL's path and on the generic one, on keys of their own
    (named alike, so that messages compare); assert they agree and that the SQL path ran."""
    postgres, memory = _engines()
    key = f"q:{uuid.uuid4().hex[:8]}"
    calls = _Recorder()
    with connection.execute_wrapper(calls):
        on_postgres = scenario(postgres, key)
    assert any("durable_admit_queued(" in sql for sql in calls.sql), "the SQL path was not taken"
    on_memory = scenario(memory, key)
    assert on_postgres == on_memory
    return on_postgres


class _Recorder:
    def __init__(self) -> None:
        self.sql: list[str] = []

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.sql.append(sql)
        return execute(sql, params, many, context)


def _start(engine: Engine, *quotas: Concurrency, parent: str | None = None) -> Any:
    return _outcome(lambda: engine.start("w", {}, concurrency=list(quotas), parent_run_id=parent))


def test_room_full_and_queued_behind_others() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        quota = Concurrency(key=key, limit=1, strategy=GRR)
        wider = Concurrency(key=key, limit=2, strategy=GRR)
        return [
            _start(engine, quota),  # room
            _start(engine, quota),  # full: queued
            _start(engine, quota),
            # A wider limit has room, but two runs wait: queued behind them, and the
            # hand-off on commit gives the freed room to the oldest.
            _start(engine, wider),
            sorted(r.status for r in engine.list_runs(tag=f"concurrency:{key}")),
        ]

    assert _both(scenario) == ["pending", "queued", "queued", "queued", ["pending", "pending", "queued", "queued"]]


def test_refusals_and_their_precedence() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        one = Concurrency(key=key, limit=1, strategy=GRR, max_queued=1)
        other = Concurrency(key=f"{key}:r", limit=1)
        return [
            _start(engine, one),
            _start(engine, one),  # queued: the queue holds 1
            _start(engine, one),  # the queue is full
            _start(engine, Concurrency(key=f"{key}:z", limit=0, strategy=GRR)),  # can never make room
            _start(engine, other),
            # The REJECT key is full and the GRR key's queue too: REJECT refuses first,
            # whatever the order of the quotas.
            _start(engine, one, other),
        ]

    outcomes = _both(scenario)
    assert outcomes[:2] == ["pending", "queued"]
    assert outcomes[2][0] == "ConcurrencyQueueFullError" and outcomes[2][2]["max_queued"] == 1
    assert outcomes[3][0] == "ConcurrencyLimitError" and outcomes[3][2]["limit"] == 0
    assert outcomes[5][0] == "ConcurrencyLimitError" and outcomes[5][2]["key"].endswith(":r")


def test_a_lifetime_cap_filled_by_finished_runs() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        cap = Concurrency(key=key, limit=1, strategy=GRR, count_statuses=("pending", "running", "completed"))
        first = engine.start("w", {}, concurrency=[cap])
        engine.store.transition(first.run_id, from_statuses=["pending"], to="completed")
        return [_start(engine, cap)]

    [refused] = _both(scenario)
    assert refused[0] == "ConcurrencyLimitError" and "lifetime cap" in refused[1]


def test_a_child_is_refused_rather_than_queued_behind_its_parent() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        quota = Concurrency(key=key, limit=1, strategy=GRR)
        parent = engine.start("w", {}, concurrency=[quota])
        outcome = _start(engine, quota, parent=parent.run_id)
        return [outcome[0], outcome[1].replace(parent.run_id, "<parent>")]

    name, message = _both(scenario)
    assert name == "ConcurrencyLimitError" and "ancestor run '<parent>'" in message


def test_a_run_admitted_directly_moves_the_round_robin_cursor() -> None:
    postgres, _ = _engines()
    key = f"q:{uuid.uuid4().hex[:8]}"
    quotas = [Concurrency(key=key, limit=2, strategy=GRR), Concurrency(key=f"{key}:b", limit=5)]
    handle = postgres.start("w", {}, concurrency=quotas)
    assert handle.status == RunStatus.PENDING
    cursors = dict(ConcurrencyLock.objects.filter(key__startswith=key).values_list("key", "rr_cursor"))
    assert cursors == {key: f"concurrency:{key}:b", f"{key}:b": ""}  # a REJECT key keeps no cursor


def test_hand_offs_serve_groups_round_robin_like_the_generic_promoter() -> None:
    def scenario(engine: Engine, key: str) -> list[Any]:
        shared = Concurrency(key=key, limit=1, strategy=GRR)
        started = engine.start("w", {}, concurrency=[shared])
        queued = []
        for tenant in ("b", "a", "b", "c", "a"):
            queued.append(engine.start("w", {}, concurrency=[shared, Concurrency(key=f"{key}:{tenant}", limit=5)]))
        names = {handle.run_id: i for i, handle in enumerate(queued)}
        order = []
        holder = started.run_id
        for _ in queued:
            engine.store.transition(holder, from_statuses=["pending"], to="completed")
            [holder] = engine.promoter.promote(run_id=holder)
            order.append(names[holder])
        return order

    assert _both(scenario) == [1, 0, 3, 4, 2]  # a, b, c, then a and b again, oldest first in each group
