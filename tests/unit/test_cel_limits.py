"""``Concurrency(limit="<CEL>")``: a limit computed from the input (and the key) at
each start, on DjangoStore (PostgreSQL's admission functions or SQLite's ORM path,
as DATABASE_URL says) and InMemoryStore."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

import durable
from durable import (
    Concurrency,
    ConcurrencyLimitError,
    DjangoStore,
    Engine,
    InMemoryStore,
    RunStatus,
    Strategy,
    exceptions,
    models,
    schedules,
)
from durable.concurrency import resolve
from durable.exceptions import InvalidStartError
from durable.models import ConcurrencyLock, RunTag, WorkflowRun
from durable.runtime import Registry
from durable.stores import RunRecord

pytestmark = pytest.mark.django_db

#: Premium tenants may have 3 runs in flight, the others 1.
TIERED = "input.tier == 'premium' ? 3 : 1"


def _noop(ctx: Any, input: Any) -> None:
    return None


def _no_dispatch(engine: Engine, run: RunRecord) -> None:
    """Runs stay pending: these tests are about admission only."""


@pytest.fixture(params=["django", "memory"])
def engine(request: pytest.FixtureRequest) -> Engine:
    store = DjangoStore() if request.param == "django" else InMemoryStore()
    return Engine(store, dispatch=_no_dispatch, registry=Registry())


def register(engine: Engine, limit: Any = TIERED, **options: Any) -> None:
    options.setdefault("expression", "'tenant:' + input.tenant")
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(limit=limit, **options))


def start(engine: Engine, tenant: str = "acme", tier: str = "free") -> Any:
    return engine.start("chat.turn", {"tenant": tenant, "tier": tier})


def finish(engine: Engine, run_id: str) -> None:
    assert engine.store.transition(run_id, from_statuses=list(RunStatus.values), to=RunStatus.COMPLETED)


def recorded_limit(engine: Engine, key: str = "tenant:acme") -> int | None:
    """The limit the key's lock row records (the latest start's)."""
    return engine.store.quota_settings([key])[key][0]


@contextmanager
def sql_admission(engine: Engine, function: str) -> Iterator[None]:
    """On PostgreSQL, check that the start went through the SQL admission ``function``
    (the limit passed per start in its JSON argument)."""
    on_postgres = isinstance(engine.store, DjangoStore) and connection.vendor == "postgresql"
    with CaptureQueriesContext(connection) as queries:
        yield
    if on_postgres:
        assert any(f"{function}(" in q["sql"] for q in queries.captured_queries), function


def assert_nothing_created(engine: Engine) -> None:
    assert engine.count_runs() == 0
    assert engine.store.quota_settings(["tenant:acme", "k"]) == {}
    if isinstance(engine.store, DjangoStore):
        assert not WorkflowRun.objects.exists()
        assert not RunTag.objects.exists()
        assert not ConcurrencyLock.objects.exists()


# -- declaration -----------------------------------------------------------------------


def test_a_cel_limit_is_kept_as_its_expression() -> None:
    spec = Concurrency(key="k", limit=TIERED)
    assert spec.limit == TIERED
    assert spec.limit_expression == TIERED
    assert TIERED in repr(spec)
    assert Concurrency(key="k", limit=3).limit_expression is None
    # Not what a per-start quota takes: the limit is computed, not a number.
    assert not spec.is_static
    assert Concurrency(key="k", limit=3).is_static


@pytest.mark.parametrize(
    "limit, message",
    [
        ("input.tier ==", "Invalid CEL concurrency limit 'input.tier ==': .*Syntax error"),
        ("plan.max", r"The CEL concurrency limit 'plan.max' may only use `input` and `key`, not plan"),
        ("", r"Concurrency\(limit=...\) must be a CEL expression string"),
        ("   ", r"Concurrency\(limit=...\) must be a CEL expression string"),
        # A constant is evaluated at declaration: one that is no limit fails there.
        ("2.5", r"must give an integer, got 2.5 \(a double\) at declaration"),
        ("true", r"must give an integer, got True \(a bool\) at declaration"),
        ("'8'", r"must give an integer, got '8' \(a string\) at declaration"),
        ("null", r"must give an integer, got None \(a null\) at declaration"),
        ("2147483648", "at declaration must be from -2147483648 to 2147483647"),
        ("-2147483649", "at declaration must be from -2147483648 to 2147483647"),
        ("1 / 0", "raised ZeroDivisionError at declaration"),
    ],
)
def test_a_bad_cel_limit_is_refused_at_declaration(limit: str, message: str) -> None:
    with pytest.raises(InvalidStartError, match=message):
        Concurrency(key="k", limit=limit)


@pytest.mark.parametrize("limit", [2.5, b"3", [3], None])
def test_a_limit_of_another_type_is_refused_at_declaration(limit: Any) -> None:
    with pytest.raises(InvalidStartError, match="must be an int, a CEL expression"):
        Concurrency(key="k", limit=limit)


@pytest.mark.parametrize("limit, expected", [("5", 5), ("2u", 2), ("-2147483648", -(2**31)), ("2147483647", 2**31 - 1)])
def test_a_constant_cel_limit(limit: str, expected: int) -> None:
    assert resolve([Concurrency(key="k", limit=limit)], None)[0].limit == expected


def test_a_cel_limit_per_start_is_refused(engine: Engine) -> None:
    register(engine)
    with pytest.raises(InvalidStartError, match="per-start Concurrency takes a plain string key and an integer limit"):
        engine.start("chat.turn", {"tenant": "acme", "tier": "free"}, concurrency=Concurrency(key="k", limit="3"))
    assert_nothing_created(engine)


# -- at start --------------------------------------------------------------------------


def test_the_limit_is_computed_from_each_starts_input(engine: Engine) -> None:
    register(engine)
    for _ in range(3):
        start(engine, "big", "premium")
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, "big", "premium")
    assert (info.value.key, info.value.limit, info.value.active) == ("tenant:big", 3, 3)
    start(engine, "small")
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, "small")
    assert (info.value.key, info.value.limit, info.value.active) == ("tenant:small", 1, 1)
    assert engine.count_runs() == 4


def test_the_limit_may_use_the_key(engine: Engine) -> None:
    engine.register("w", "1", _noop, concurrency=Concurrency(key=lambda i: i["group"], limit="key.startsWith('batch:') ? 2 : 1"))
    engine.start("w", {"group": "batch:nightly"})
    engine.start("w", {"group": "batch:nightly"})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("w", {"group": "batch:nightly"})
    assert info.value.limit == 2
    engine.start("w", {"group": "live"})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("w", {"group": "live"})
    assert info.value.limit == 1


def test_a_key_left_unlimited_computes_no_limit(engine: Engine) -> None:
    # The limit would fail on this input (no tier), but no key means no limit to compute.
    engine.register("w", "1", _noop, concurrency=Concurrency(expression="has(input.tenant) ? input.tenant : null", limit=TIERED))
    for _ in range(3):
        engine.start("w", {})
    assert engine.count_runs() == 3


def test_two_entries_on_one_key_keep_the_smaller_computed_limit(engine: Engine) -> None:
    engine.register(
        "w",
        "1",
        _noop,
        concurrency=[Concurrency(key="k", limit="input.a"), Concurrency(key="k", limit="input.b")],
    )
    engine.start("w", {"a": 2, "b": 1})
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("w", {"a": 1, "b": 2})
    assert info.value.limit == 1


@pytest.mark.parametrize("strategy", [Strategy.REJECT, Strategy.GROUP_ROUND_ROBIN])
@pytest.mark.parametrize(
    "input, message",
    [
        ({"tenant": "acme"}, r"raised KeyError for key 'tenant:acme': 'tier'\. Check that the input has the fields"),
        ({"tenant": "acme", "m": "x"}, "raised TypeError for key 'tenant:acme': "),
        ({"tenant": "acme", "n": 2.0}, r"must give an integer, got 2.0 \(a double\) for key 'tenant:acme'"),
        ({"tenant": "acme", "n": True}, r"must give an integer, got True \(a bool\)"),
        ({"tenant": "acme", "n": "4"}, r"must give an integer, got '4' \(a string\)"),
        ({"tenant": "acme", "n": None}, r"must give an integer, got None \(a null\)"),
        ({"tenant": "acme", "n": [1]}, r"must give an integer, got \[1\] \(a list\)"),
        ({"tenant": "acme", "n": 2**31}, "for key 'tenant:acme' must be from -2147483648 to 2147483647"),
        ({"tenant": "acme", "n": -(2**31) - 1}, "must be from -2147483648 to 2147483647"),
        ({"tenant": "acme", "n": 0, "d": 0}, "raised ZeroDivisionError"),
    ],
    ids=["missing-field", "type-error", "double", "bool", "string", "null", "list", "too-big", "too-small", "div-by-zero"],
)
def test_a_limit_that_fails_at_start_is_a_clear_error_creating_nothing(
    engine: Engine, strategy: Strategy, input: dict[str, Any], message: str
) -> None:
    limit = "has(input.d) ? 10 / input.d : has(input.m) ? input.m * 2 : has(input.n) ? input.n : input.tier == 'premium' ? 3 : 1"
    register(engine, limit=limit, strategy=strategy)
    with pytest.raises(InvalidStartError, match=message):
        engine.start("chat.turn", input)
    assert_nothing_created(engine)


def test_a_limit_that_fails_leaves_the_keys_row_as_the_last_start_set_it(engine: Engine) -> None:
    register(engine, limit="has(input.n) ? input.n : 2")
    start(engine)
    assert recorded_limit(engine) == 2
    with pytest.raises(InvalidStartError):
        engine.start("chat.turn", {"tenant": "acme", "n": 2.5})
    assert recorded_limit(engine) == 2
    assert engine.count_runs() == 1


# -- two starts of one key computing different limits ---------------------------------------


def test_each_start_applies_its_own_limit_to_all_the_keys_runs(engine: Engine) -> None:
    register(engine)
    with sql_admission(engine, "durable_admit"):
        premium = [start(engine, tier="premium"), start(engine, tier="premium")]
    assert recorded_limit(engine) == 3
    # A free start counts the premium runs too: 2 in flight, its limit is 1.
    with pytest.raises(ConcurrencyLimitError) as info, sql_admission(engine, "durable_admit"):
        start(engine)
    assert (info.value.limit, info.value.active) == (1, 2)
    assert recorded_limit(engine) == 1  # a refused start records its limit too
    # A premium start still fits under its own limit, and records it.
    premium.append(start(engine, tier="premium"))
    assert recorded_limit(engine) == 3
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, tier="premium")
    assert (info.value.limit, info.value.active) == (3, 3)
    finish(engine, premium[0].run_id)
    finish(engine, premium[1].run_id)
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine)  # 1 in flight: the free limit is reached
    assert (info.value.limit, info.value.active) == (1, 1)
    finish(engine, premium[2].run_id)
    free = start(engine)
    assert free.refresh().status == RunStatus.PENDING
    assert recorded_limit(engine) == 1
    assert engine.count_runs(tag="concurrency:tenant:acme", statuses=[RunStatus.PENDING]) == 1


def test_a_queued_start_and_its_hand_off_use_the_latest_limit(engine: Engine) -> None:
    register(engine, strategy=Strategy.GROUP_ROUND_ROBIN)
    with sql_admission(engine, "durable_admit_queued"):
        first, second = start(engine, tier="premium"), start(engine, tier="premium")
        free = start(engine)  # 2 in flight, its limit is 1: queued
    assert [r.refresh().status for r in (first, second, free)] == [RunStatus.PENDING, RunStatus.PENDING, RunStatus.QUEUED]
    assert recorded_limit(engine) == 1
    # A hand-off applies the limit the key's row records (the free start's 1):
    # with one premium run still in flight the queued run stays queued.
    finish(engine, first.run_id)
    engine.promoter.promote(["tenant:acme"])
    assert free.refresh().status == RunStatus.QUEUED
    finish(engine, second.run_id)
    engine.promoter.promote(["tenant:acme"])
    assert free.refresh().status == RunStatus.PENDING
    # A premium start then applies its own limit again: 1 in flight of 3.
    assert start(engine, tier="premium").refresh().status == RunStatus.PENDING
    assert recorded_limit(engine) == 3


def test_an_operators_override_replaces_the_computed_limit(engine: Engine) -> None:
    register(engine)
    start(engine, tier="premium")
    engine.set_limit_override("tenant:acme", 1, "incident 42")
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, tier="premium")
    assert (info.value.limit, info.value.active) == (1, 1)
    check = engine.would_admit("chat.turn", {"tenant": "acme", "tier": "premium"})
    assert (check.outcome, check.keys[0].limit, check.keys[0].code_limit, check.keys[0].override) == ("reject", 1, 3, 1)
    # An override above a free start's computed limit lets it in.
    engine.set_limit_override("tenant:acme", 2, "catch up")
    start(engine)
    assert recorded_limit(engine) == 1  # the row still records the code's (computed) limit
    engine.set_limit_override("tenant:acme", None, "incident over")
    start(engine, tier="premium")  # the premium limit (3) again: 2 in flight
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, tier="premium")
    assert (info.value.limit, info.value.active) == (3, 3)


def test_would_admit_computes_the_limit_from_the_input(engine: Engine) -> None:
    register(engine)
    start(engine)
    premium = engine.would_admit("chat.turn", {"tenant": "acme", "tier": "premium"})
    free = engine.would_admit("chat.turn", {"tenant": "acme", "tier": "free"})
    assert (premium.outcome, premium.limit, premium.active) == ("admit", 3, 1)
    assert (free.outcome, free.limit, free.active) == ("reject", 1, 1)
    with pytest.raises(InvalidStartError, match="raised KeyError"):
        engine.would_admit("chat.turn", {"tenant": "acme"})


def test_a_schedule_under_the_workflows_quota_needs_an_input_the_limit_computes_from() -> None:
    durable.engine.register("test.cel_limit", "1", _noop, concurrency=Concurrency(key="k", limit=TIERED))
    try:
        with pytest.raises(exceptions.InvalidScheduleError) as caught:
            schedules.create_schedule("nightly", "test.cel_limit", {"tenant": "acme"}, every=3600)
        assert any("own quota cannot be computed from this input" in m for m in caught.value.errors["input"])
        assert "raised KeyError for key 'k': 'tier'" in str(caught.value)
        assert not models.Schedule.objects.exists()
        schedules.create_schedule("nightly", "test.cel_limit", {"tenant": "acme", "tier": "premium"}, every=3600)
        assert models.Schedule.objects.count() == 1
    finally:
        durable.engine.registry.unregister("test.cel_limit")


def test_the_cel_package_is_imported_only_when_an_expression_is_compiled() -> None:
    """``import cel`` loads the package's command-line interface (prompt_toolkit), about 0.2 s:
    a process that sets Django up with durable, its tasks and its admin, and declares no CEL
    quota, does not import it; the first expression declared does."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, django\n"
        "django.setup()\n"
        "import durable.tasks, durable.admin, durable.api\n"
        "before = 'cel' in sys.modules\n"
        "from durable import Concurrency\n"
        "Concurrency(key=lambda input: 'k', limit=1)\n"
        "plain = 'cel' in sys.modules\n"
        "Concurrency(expression='input.group', limit=1)\n"
        "print(before, plain, 'cel' in sys.modules)\n"
    )
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="testproject.settings")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True"]
