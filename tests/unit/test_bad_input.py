"""Bad input gets a clear error and creates nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest

from durable import Concurrency, DjangoStore, Engine, InMemoryStore, Strategy
from durable.exceptions import InvalidStartError, UnknownWorkflowError
from durable.models import ConcurrencyLock, RunTag, WorkflowRun
from durable.runtime import Registry

pytestmark = pytest.mark.django_db


def _noop(ctx: Any, input: Any) -> None:
    return None


@pytest.fixture(params=["django", "memory"])
def engine(request: pytest.FixtureRequest) -> Engine:
    store = DjangoStore() if request.param == "django" else InMemoryStore()
    return Engine(store, dispatch=lambda engine, run_id: None, registry=Registry())


def assert_nothing_created(engine: Engine) -> None:
    assert engine.count_runs() == 0
    if isinstance(engine.store, DjangoStore):
        assert not WorkflowRun.objects.exists()
        assert not RunTag.objects.exists()


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "bad",
    [{1, 2}, object(), {"when": b"bytes"}, math.nan, {"x": math.inf}, "a\x00b", {"k": "\ud800"}, _deep(5000)],
    ids=["set", "object", "bytes", "nan", "inf", "nul", "lone-surrogate", "too-deep"],
)
def test_non_json_input_is_refused(engine: Engine, bad: Any) -> None:
    engine.register("w", "1", _noop, concurrency=Concurrency(key="k", limit=5))
    with pytest.raises(ValueError, match="must be a JSON value"):
        engine.start("w", bad)
    assert_nothing_created(engine)


def test_key_function_that_raises(engine: Engine) -> None:
    engine.register("w", "1", _noop, concurrency=Concurrency(key=lambda i: f"tenant:{i['tenant']}", limit=5))
    with pytest.raises(InvalidStartError, match="key function raised KeyError") as info:
        engine.start("w", {"no_tenant": True})
    assert isinstance(info.value.__cause__, KeyError)
    assert_nothing_created(engine)


@pytest.mark.parametrize("key", [42, b"bytes", "", "x" * 201])
def test_key_function_returning_a_non_string_or_bad_length(engine: Engine, key: Any) -> None:
    engine.register("w", "1", _noop, concurrency=Concurrency(key=lambda i: key, limit=5))
    with pytest.raises(InvalidStartError, match="concurrency key"):
        engine.start("w", {})
    assert_nothing_created(engine)


def test_limit_function_that_raises(engine: Engine) -> None:
    def limit(key: str) -> int:
        raise RuntimeError("plans service down")

    engine.register("w", "1", _noop, concurrency=Concurrency(key="k", limit=limit))
    with pytest.raises(InvalidStartError, match="limit function raised RuntimeError"):
        engine.start("w", {})
    assert_nothing_created(engine)
    if isinstance(engine.store, DjangoStore):
        assert not ConcurrencyLock.objects.exists()


@pytest.mark.parametrize("value", ["8", 2.5, None, True])
def test_limit_function_returning_a_non_integer(engine: Engine, value: Any) -> None:
    engine.register("w", "1", _noop, concurrency=Concurrency(key="k", limit=lambda key: value))
    with pytest.raises(InvalidStartError, match="must be an integer"):
        engine.start("w", {})
    assert_nothing_created(engine)


def test_unknown_workflow(engine: Engine) -> None:
    with pytest.raises(UnknownWorkflowError, match="No workflow is registered under the name 'nope'"):
        engine.start("nope", {})
    assert_nothing_created(engine)


@pytest.mark.parametrize("run_id", ["", 42, "x" * 256])
def test_bad_run_id(engine: Engine, run_id: Any) -> None:
    engine.register("w", "1", _noop)
    with pytest.raises(InvalidStartError, match="run id"):
        engine.start("w", {}, run_id=run_id)
    assert_nothing_created(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"key": None}, "exactly one of key"),
        ({"key": "k", "expression": "input.k"}, "exactly one of key"),
        ({"key": 5}, "must be a string or a function"),
        ({"key": "k", "limit": "8"}, "must be an int or a function"),
        ({"key": "k", "count_statuses": ["running", "sleeping"]}, "count_statuses"),
        ({"key": "k", "count_statuses": "running"}, "count_statuses"),
        ({"key": "k", "strategy": "fastest"}, "must be a Strategy"),
        ({"key": "k", "count_statuses": ["queued"]}, "count_statuses"),
        ({"key": "k", "max_queued": 3}, "only applies to Strategy.GROUP_ROUND_ROBIN"),
        ({"key": "k", "strategy": Strategy.GROUP_ROUND_ROBIN, "max_queued": -1}, "non-negative integer"),
        ({"expression": "input.(", "limit": 1}, "Invalid CEL concurrency expression"),
        ({"expression": "tenant.id", "limit": 1}, "may only use `input`, not tenant"),
        ({"expression": "", "limit": 1}, "must be a CEL expression string"),
    ],
)
def test_bad_concurrency_declaration(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidStartError, match=message):
        Concurrency(**kwargs)


def test_bad_concurrency_type_per_start(engine: Engine) -> None:
    engine.register("w", "1", _noop)
    with pytest.raises(InvalidStartError, match="must be a Concurrency"):
        engine.start("w", {}, concurrency={"key": "k", "limit": 1})  # type: ignore[arg-type]
    assert_nothing_created(engine)


def test_restart_with_the_run_id_of_another_workflow_or_namespace_is_refused(engine: Engine) -> None:
    from durable.exceptions import RunIdTaken

    engine.register("w", "1", _noop)
    engine.register("other", "1", _noop)
    engine.start("w", {}, run_id="taken")
    with pytest.raises(RunIdTaken, match="already used by another run"):
        engine.start("other", {}, run_id="taken")
    tenant_b = Engine(engine.store, namespace="b", scope_reads=True, dispatch=engine.dispatch, registry=engine.registry)
    with pytest.raises(RunIdTaken):
        tenant_b.start("w", {}, run_id="taken")
    assert engine.count_runs() == 1


def test_run_lookup_with_an_impossible_id_is_not_found(engine: Engine) -> None:
    from durable import RunNotFound

    for run_id in ["a\x00b", "", "x" * 300]:
        with pytest.raises(RunNotFound):
            engine.get_run(run_id)
