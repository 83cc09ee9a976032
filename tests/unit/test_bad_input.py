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


@pytest.mark.parametrize("bad", [{1, 2}, object(), {"when": b"bytes"}, math.nan, {"x": math.inf}])
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
        ({"key": None}, "must be a string or a function"),
        ({"key": 5}, "must be a string or a function"),
        ({"key": "k", "limit": "8"}, "must be an int or a function"),
        ({"key": "k", "count_statuses": ["running", "sleeping"]}, "count_statuses"),
        ({"key": "k", "count_statuses": "running"}, "count_statuses"),
        ({"key": "k", "strategy": "fastest"}, "must be a Strategy"),
        ({"key": "k", "strategy": Strategy.GROUP_ROUND_ROBIN}, "not supported by this release"),
        ({"expression": "input.group"}, "not supported by this release"),
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
