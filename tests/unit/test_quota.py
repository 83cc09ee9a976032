"""The quota rules (docs/explanation/quotas.md, "The rules"): one test per rule, on DjangoStore and InMemoryStore."""

from __future__ import annotations

from typing import Any

import pytest

from durable import (
    DEFAULT_CONCURRENCY_STATUSES,
    Concurrency,
    ConcurrencyLimitError,
    DjangoStore,
    Engine,
    InMemoryStore,
    RunStatus,
)
from durable.exceptions import InvalidStartError
from durable.runtime import Registry
from durable.stores import BaseStore, RunRecord


def _noop(ctx: Any, input: Any) -> Any:
    return None


def _no_dispatch(engine: Engine, run: RunRecord) -> None:
    """Runs stay pending: these tests are about admission only."""


pytestmark = pytest.mark.django_db


@pytest.fixture(params=["django", "memory"])
def make_engine(request: pytest.FixtureRequest):
    def make(**kwargs: Any) -> Engine:
        store = DjangoStore() if request.param == "django" else InMemoryStore()
        kwargs.setdefault("registry", Registry())
        return Engine(store, dispatch=_no_dispatch, **kwargs)

    return make


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()


def tenant_key(input: dict[str, Any]) -> str | None:
    return None if input.get("tenant") is None else f"tenant:{input['tenant']}"


def finish(engine: Engine, run_id: str, status: str = RunStatus.COMPLETED) -> None:
    assert engine.store.transition(run_id, from_statuses=list(RunStatus.values), to=status)


def test_rule1_over_limit_raises_with_fields_and_creates_nothing(engine: Engine) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=2))
    first = engine.start("chat.turn", {"tenant": "acme"})
    engine.start("chat.turn", {"tenant": "acme"})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "acme"}, run_id="third")
    error = info.value
    assert (error.workflow, error.key, error.limit, error.active) == ("chat.turn", "tenant:acme", 2, 2)
    assert error.code == "concurrency_limit"
    assert engine.store.get_run("third") is None
    assert engine.count_runs() == 2
    assert engine.count_runs(tag="concurrency:tenant:acme") == 2
    assert first.created


def test_rule2_key_none_leaves_start_unlimited(engine: Engine) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=1))
    for _ in range(5):
        handle = engine.start("chat.turn", {"tenant": None})
        assert handle.record.tags == []
    assert engine.count_runs() == 5


def test_rule2_per_start_key_is_a_plain_string(engine: Engine) -> None:
    engine.register("chat.turn", "1", _noop)
    engine.start("chat.turn", {}, concurrency=Concurrency(key="tenant:x", limit=1))
    with pytest.raises(ConcurrencyLimitError):
        engine.start("chat.turn", {}, concurrency=Concurrency(key="tenant:x", limit=1))
    with pytest.raises(InvalidStartError, match="plain string key"):
        engine.start("chat.turn", {}, concurrency=Concurrency(key=lambda i: "tenant:x", limit=1))


def test_rule3_key_is_global_across_workflows(engine: Engine) -> None:
    quota = Concurrency(key=tenant_key, limit=2)
    engine.register("chat.turn", "1", _noop, concurrency=quota)
    engine.register("report.build", "1", _noop, concurrency=quota)
    engine.start("chat.turn", {"tenant": "acme"})
    engine.start("report.build", {"tenant": "acme"})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "acme"})
    assert info.value.active == 2
    engine.start("report.build", {"tenant": "other"})


def test_rule4_limit_from_sync_function_of_the_key(engine: Engine) -> None:
    plans = {"tenant:big": 3, "tenant:small": 1}
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=plans.__getitem__))
    for _ in range(3):
        engine.start("chat.turn", {"tenant": "big"})
    engine.start("chat.turn", {"tenant": "small"})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "small"})
    assert info.value.limit == 1
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "big"})
    assert info.value.limit == 3


def test_rule4_limit_from_async_function_of_the_key(engine: Engine) -> None:
    seen: list[str] = []

    async def limit(key: str) -> int:
        seen.append(key)
        return 1

    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=limit))
    engine.start("chat.turn", {"tenant": "acme"})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "acme"})
    assert info.value.limit == 1
    assert seen == ["tenant:acme", "tenant:acme"]


@pytest.mark.parametrize("limit", [0, -3])
def test_rule4_limit_zero_or_less_rejects_every_start(engine: Engine, limit: int) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=limit))
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "acme"})
    assert (info.value.limit, info.value.active) == (limit, 0)
    assert engine.count_runs() == 0


def test_rule5_default_count_statuses_hold_a_slot(engine: Engine) -> None:
    assert DEFAULT_CONCURRENCY_STATUSES == ("pending", "running", "suspended", "blocked")
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=4))
    handles = [engine.start("chat.turn", {"tenant": "acme"}) for _ in range(4)]
    for handle, status in zip(handles, DEFAULT_CONCURRENCY_STATUSES, strict=False):
        finish(engine, handle.run_id, status)
    with pytest.raises(ConcurrencyLimitError):
        engine.start("chat.turn", {"tenant": "acme"})


def test_rule5_narrowed_count_statuses(engine: Engine) -> None:
    quota = Concurrency(key=tenant_key, limit=1, count_statuses=["pending", "running"])
    engine.register("chat.turn", "1", _noop, concurrency=quota)
    parked = engine.start("chat.turn", {"tenant": "acme"})
    finish(engine, parked.run_id, RunStatus.SUSPENDED)  # parked on a human: holds no slot
    engine.start("chat.turn", {"tenant": "acme"})
    with pytest.raises(ConcurrencyLimitError):
        engine.start("chat.turn", {"tenant": "acme"})


def test_rule6_run_carries_the_concurrency_tag(engine: Engine) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=5))
    handle = engine.start("chat.turn", {"tenant": "acme"})
    assert [h.run_id for h in engine.list_runs(tag="concurrency:tenant:acme")] == [handle.run_id]
    assert engine.count_runs(tag="concurrency:tenant:acme", statuses=["pending"]) == 1


def test_rule6_custom_store_without_count_runs_falls_back_to_list_runs() -> None:
    class ListOnlyStore(InMemoryStore):
        listed = 0
        count_runs = BaseStore.count_runs  # what a store that does not write count_runs gets

        def list_runs(self, **kwargs: Any) -> list[Any]:
            type(self).listed += 1
            return super().list_runs(**kwargs)

    engine = Engine(ListOnlyStore(), dispatch=_no_dispatch, registry=Registry())
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=1))
    engine.start("chat.turn", {"tenant": "acme"})
    with pytest.raises(ConcurrencyLimitError):
        engine.start("chat.turn", {"tenant": "acme"})
    assert ListOnlyStore.listed == 2


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled", "dead"])
def test_rule7_slot_frees_when_the_run_leaves_the_counted_statuses(engine: Engine, status: str) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=1))
    first = engine.start("chat.turn", {"tenant": "acme"})
    with pytest.raises(ConcurrencyLimitError):
        engine.start("chat.turn", {"tenant": "acme"})
    finish(engine, first.run_id, status)
    assert engine.start("chat.turn", {"tenant": "acme"}).created


def test_rule7_cancel_frees_the_slot(engine: Engine) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=1))
    first = engine.start("chat.turn", {"tenant": "acme"})
    assert first.cancel().status == RunStatus.CANCELLED
    assert engine.start("chat.turn", {"tenant": "acme"}).created


def test_rule9_idempotent_restart_is_never_rejected(engine: Engine) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=1))
    first = engine.start("chat.turn", {"tenant": "acme"}, run_id="turn-42")
    again = engine.start("chat.turn", {"tenant": "acme"}, run_id="turn-42")
    assert (again.run_id, again.created) == ("turn-42", False)
    assert first.created
    assert engine.count_runs() == 1


def test_rule11_per_start_concurrency_replaces_the_workflow_quota(engine: Engine) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=tenant_key, limit=1, count_statuses=["pending"]))
    override = Concurrency(key="plan:acme", limit=2, count_statuses=["running"])
    a = engine.start("chat.turn", {"tenant": "acme"}, concurrency=override)
    b = engine.start("chat.turn", {"tenant": "acme"}, concurrency=override)
    # Not merged: the workflow's tenant key was not used (its limit 1 would have refused b).
    assert a.record.tags == b.record.tags == ["concurrency:plan:acme"]
    # Its count_statuses are the override's: pending runs do not count...
    engine.start("chat.turn", {"tenant": "acme"}, concurrency=override)
    finish(engine, a.run_id, RunStatus.RUNNING)
    finish(engine, b.run_id, RunStatus.RUNNING)
    # ...running ones do.
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "acme"}, concurrency=override)
    assert (info.value.key, info.value.limit, info.value.active) == ("plan:acme", 2, 2)


def test_several_keys_need_room_under_every_one(engine: Engine) -> None:
    engine.register(
        "chat.turn",
        "1",
        _noop,
        concurrency=[Concurrency(key=tenant_key, limit=5), Concurrency(key="global", limit=2)],
    )
    engine.start("chat.turn", {"tenant": "a"})
    engine.start("chat.turn", {"tenant": "b"})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "c"})
    assert info.value.key == "global"


def test_scope_reads_fences_the_count_to_the_namespace(make_engine) -> None:
    registry = Registry()
    a = make_engine(namespace="a", scope_reads=True, registry=registry)
    registry.register("chat.turn", "1", _noop, Concurrency(key="shared", limit=1))
    b = Engine(a.store, namespace="b", scope_reads=True, dispatch=_no_dispatch, registry=registry)
    unscoped = Engine(a.store, namespace="c", dispatch=_no_dispatch, registry=registry)
    a.start("chat.turn", {})
    b.start("chat.turn", {})  # its own namespace has room
    with pytest.raises(ConcurrencyLimitError) as info:
        unscoped.start("chat.turn", {})  # counts every namespace
    assert info.value.active == 2
    assert [h.namespace for h in b.list_runs()] == ["b"]
