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
    return Engine(store, dispatch=lambda engine, run: None, registry=Registry())


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
        ({"key": "k", "limit": 2.5}, "must be an int, a CEL expression \\(a string\\) or a function"),
        ({"key": "k", "limit": "input."}, "Invalid CEL concurrency limit"),
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


# -- run ids the HTTP API's URLs can address ------------------------------------------------


@pytest.mark.parametrize(
    "run_id",
    ["x/cancel", "y/signal", "a/b", "t\nnl", "tab\there", "del\x7f", "\x85next-line", " lead", "trail ", "\ud800", ".", ".."],
    ids=[
        "cancel",
        "signal",
        "slash",
        "newline",
        "tab",
        "del",
        "c1-control",
        "leading-space",
        "trailing-space",
        "lone-surrogate",
        "dot",
        "dotdot",
    ],
)
def test_run_id_that_no_url_can_address_is_refused(engine: Engine, run_id: str) -> None:
    engine.register("w", "1", _noop)
    with pytest.raises(InvalidStartError, match="run id"):
        engine.start("w", {}, run_id=run_id)
    assert_nothing_created(engine)


@pytest.mark.parametrize("run_id", ["order-42", "event:e1:w", "a b", "ü:ß:😀", "x" * 255, "a.b", "...", "?#%"])
def test_run_id_rule_accepts_ordinary_ids(engine: Engine, run_id: str) -> None:
    engine.register("w", "1", _noop)
    assert engine.start("w", {}, run_id=run_id).run_id == run_id


def test_a_stored_run_id_with_a_slash_stays_readable_and_cancellable(engine: Engine) -> None:
    """Runs created before the rule (their ids may hold "/") are not affected by it."""
    from durable.status import RunStatus
    from durable.stores import RunRecord

    engine.register("w", "1", _noop)
    record = RunRecord(run_id="legacy/1", workflow="w", version="1", namespace="default", status=RunStatus.PENDING)
    engine.store.create_run(record, [])
    assert engine.get_run("legacy/1").status == "pending"
    assert engine.start("w", {}, run_id="legacy/1").created is False
    assert engine.cancel("legacy/1").status == "cancelled"


# -- limits the database can hold ------------------------------------------------------------------

INT_MAX = 2**31 - 1


@pytest.mark.parametrize("limit", [2**31, 2**63, -(2**31) - 1])
def test_declared_limit_out_of_the_columns_range_is_refused(limit: int) -> None:
    with pytest.raises(InvalidStartError, match="2147483647"):
        Concurrency(key="k", limit=limit)


@pytest.mark.parametrize("limit", [2**31, 10**20, -(2**31) - 1])
def test_limit_function_returning_a_limit_out_of_range(engine: Engine, limit: int) -> None:
    engine.register("w", "1", _noop, concurrency=Concurrency(key="k", limit=lambda key: limit))
    with pytest.raises(InvalidStartError, match="2147483647"):
        engine.start("w", {})
    assert_nothing_created(engine)


@pytest.mark.parametrize("limit", [INT_MAX, -(2**31)])
def test_limits_at_the_ends_of_the_range_work(engine: Engine, limit: int) -> None:
    from durable import ConcurrencyLimitError

    engine.register("w", "1", _noop, concurrency=Concurrency(key="k", limit=lambda key: limit))
    if limit > 0:
        assert engine.start("w", {}).status == "pending"
    else:
        with pytest.raises(ConcurrencyLimitError):
            engine.start("w", {})


# -- long keys and many of them ------------------------------------------------------------------


def _keys_workflow(engine: Engine, n: int, *, strategy: Strategy = Strategy.REJECT) -> None:
    specs = [
        Concurrency(key=lambda i, n=n: i["keys"][n], limit=1 if n == 0 else 100, strategy=strategy if n == 0 else Strategy.REJECT)
        for n in range(n)
    ]
    engine.register("w", "1", _noop, concurrency=specs)


def test_six_keys_of_200_characters(engine: Engine) -> None:
    _keys_workflow(engine, 6)
    keys = [f"{n}" * 200 for n in range(6)]
    handle = engine.start("w", {"keys": keys})
    assert handle.status == "pending"
    assert engine.count_runs(tag=f"concurrency:{keys[5]}") == 1


def test_round_robin_over_groups_of_six_long_keys(engine: Engine, django_capture_on_commit_callbacks: Any) -> None:
    _keys_workflow(engine, 6, strategy=Strategy.GROUP_ROUND_ROBIN)
    shared = "s" * 200

    def keys(group: str) -> list[str]:
        return [shared] + [f"{group}{n}" * 100 for n in range(5)]

    first = engine.start("w", {"keys": keys("a")})
    queued = [engine.start("w", {"keys": keys(g)}) for g in ("b", "c")]
    assert first.status == "pending" and [h.status for h in queued] == ["queued", "queued"]
    with django_capture_on_commit_callbacks(execute=True):
        engine.cancel(first.run_id)  # hands the slot of the shared key to one group: its cursor is that group
    assert sorted(h.refresh().status for h in queued) == ["pending", "queued"]
    assert len(engine.store.rr_cursor(shared)) > 1024


def test_the_longest_key_fits_its_columns() -> None:
    from durable.concurrency import MAX_KEY_LENGTH, TAG_PREFIX

    assert len(TAG_PREFIX) + MAX_KEY_LENGTH <= RunTag._meta.get_field("tag").max_length
    assert ConcurrencyLock._meta.get_field("key").max_length >= MAX_KEY_LENGTH


# -- async limit functions called where an event loop runs ----------------------------------------


def test_async_limit_function_called_with_a_running_event_loop() -> None:
    import asyncio

    from durable.concurrency import resolve

    async def plan_limit(key: str) -> int:
        await asyncio.sleep(0)
        return 7

    async def main() -> tuple[int, str]:
        quotas = resolve([Concurrency(key="k", limit=plan_limit)], {})
        engine = Engine(InMemoryStore(), dispatch=lambda engine, run: None, registry=Registry())
        engine.register("w", "1", _noop, concurrency=Concurrency(key="k", limit=plan_limit))
        return quotas[0].limit, engine.start("w", {}).status

    assert asyncio.run(main()) == (7, "pending")


@pytest.mark.parametrize(
    ("value", "nul"),
    [
        ({"s": "a\x00b"}, True),
        ({"a\x00": 1}, True),
        (["x" * 10_000 + "\x00"], True),  # at the end of a long text
        ({"s": "\\\x00"}, True),  # a backslash, then NUL
        ({"s": "\\u0000"}, False),  # a backslash, then the letters u0000: no NUL
        ({"s": "\\\\u0000"}, False),
        ({"s": "x" * 10_000}, False),
    ],
)
def test_check_json_refuses_nul_characters_only(value: Any, nul: bool) -> None:
    from durable.util import check_json

    if nul:
        with pytest.raises(InvalidStartError, match="NUL"):
            check_json(value, what="the input")
    else:
        assert check_json(value, what="the input") == value
