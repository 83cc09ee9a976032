"""Burstable quotas (docs/how-to/burst.md): guaranteed runs, borrowed runs, the pool."""

from __future__ import annotations

from typing import Any

import pytest

from durable import Burst, Concurrency, ConcurrencyLimitError, DjangoStore, Engine, RunStatus, Strategy, http
from durable.exceptions import ChildWorkflowError, InvalidStartError, PoolBusyError, StoreUnavailable
from durable.runtime import context
from durable.status import DEFAULT_CONCURRENCY_STATUSES

pytestmark = pytest.mark.django_db(transaction=True)

COUNTED = list(DEFAULT_CONCURRENCY_STATUSES)


@pytest.fixture(autouse=True)
def pools(settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {"global": 3, "other": 1}}


def tenant(input: dict[str, Any]) -> str:
    return f"tenant:{input['tenant']}"


def bursting(limit: int = 2, up_to: int = 4, pool: str = "global") -> Concurrency:
    return Concurrency(key=tenant, limit=limit, burst=Burst(pool=pool, up_to=up_to))


def count(engine: Engine, tag: str) -> int:
    return engine.count_runs(tag=tag, statuses=COUNTED)


def start(engine: Engine, name: str = "a") -> Any:
    return engine.start("w", {"tenant": name})


def refusal(engine: Engine, name: str = "a") -> ConcurrencyLimitError:
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, name)
    return info.value


def test_runs_beyond_the_limit_borrow_from_the_pool_up_to_the_ceiling(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=2, up_to=4))
    guaranteed = [start(engine) for _ in range(2)]
    borrowed = [start(engine) for _ in range(2)]
    assert [h.record.tags for h in guaranteed] == [["concurrency:tenant:a"]] * 2
    assert [sorted(h.record.tags) for h in borrowed] == [["borrowed:tenant:a", "concurrency:global", "concurrency:tenant:a"]] * 2
    assert engine.store.run_keys(borrowed[0].run_id) == ["global", "tenant:a"]  # its end frees both
    assert (count(engine, "concurrency:tenant:a"), count(engine, "borrowed:tenant:a"), count(engine, "concurrency:global")) == (
        4,
        2,
        2,
    )
    exc = refusal(engine)
    assert (exc.source, exc.key, exc.limit, exc.active, exc.up_to, exc.borrowed) == ("up_to", "tenant:a", 2, 4, 4, 2)
    assert (exc.pool, exc.pool_limit, exc.pool_active) == ("global", 3, 2)
    assert count(engine, "concurrency:tenant:a") == 4  # the refusal created nothing


def test_a_full_pool_refuses_borrowing_but_never_the_guaranteed_part(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=2, up_to=10))
    for _ in range(2 + 3):  # a's guarantee, then the whole pool
        start(engine, "a")
    exc = refusal(engine, "a")
    assert (exc.source, exc.key, exc.limit, exc.active, exc.borrowed) == ("pool", "tenant:a", 2, 5, 3)
    assert (exc.pool, exc.pool_limit, exc.pool_active) == ("global", 3, 3)
    assert "pool 'global' is full" in str(exc)
    # Another tenant under its guarantee is admitted although the pool is full...
    b = [start(engine, "b") for _ in range(2)]
    assert [h.record.tags for h in b] == [["concurrency:tenant:b"]] * 2
    # ...and refused by the pool beyond it.
    assert refusal(engine, "b").source == "pool"
    assert count(engine, "concurrency:global") == 3


def test_a_borrowed_run_frees_its_pool_slot_when_it_finishes(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=1, up_to=10))
    start(engine, "a")
    borrowed = [start(engine, "a") for _ in range(3)]
    start(engine, "b")  # b's guarantee
    assert refusal(engine, "b").source == "pool"
    engine.execute(borrowed[0].run_id)
    assert borrowed[0].refresh().status == RunStatus.COMPLETED
    assert count(engine, "concurrency:global") == 2
    assert count(engine, "borrowed:tenant:a") == 2
    assert sorted(start(engine, "b").record.tags) == ["borrowed:tenant:b", "concurrency:global", "concurrency:tenant:b"]


def test_a_run_keeps_what_it_was_admitted_as(engine: Engine) -> None:
    """When guaranteed runs finish, the next start is guaranteed again, though borrowed runs are in flight."""
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=2, up_to=4))
    guaranteed = [start(engine) for _ in range(2)]
    [start(engine) for _ in range(2)]  # borrowed
    engine.execute(guaranteed[0].run_id)
    again = start(engine)
    assert again.record.tags == ["concurrency:tenant:a"]
    assert (count(engine, "concurrency:tenant:a"), count(engine, "borrowed:tenant:a")) == (4, 2)


def test_a_key_without_a_guarantee_only_borrows(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=0, up_to=2))
    assert sorted(start(engine).record.tags) == ["borrowed:tenant:a", "concurrency:global", "concurrency:tenant:a"]
    start(engine)
    assert refusal(engine).source == "up_to"


def test_up_to_at_the_limit_borrows_nothing(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=2, up_to=2))
    start(engine), start(engine)
    exc = refusal(engine)
    assert (exc.source, exc.limit, exc.active, exc.pool, exc.borrowed) == ("up_to", 2, 2, "global", 0)


def test_the_pool_is_a_key_a_quota_may_name(engine: Engine) -> None:
    """A start whose own quota is the pool takes a slot of it, as a borrowed run does."""
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=1, up_to=10))
    engine.register("batch", "1", lambda ctx, input: None, concurrency=Concurrency(key="global", limit=3))
    start(engine), start(engine)  # one guaranteed, one borrowed
    engine.start("batch", {}), engine.start("batch", {})
    assert count(engine, "concurrency:global") == 3
    assert refusal(engine).source == "pool"
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("batch", {})
    assert (info.value.key, info.value.source) == ("global", "limit")


def test_a_start_with_the_pool_among_its_own_keys_takes_one_slot_of_it(engine: Engine) -> None:
    both = [bursting(limit=0, up_to=5), Concurrency(key="global", limit=3)]
    engine.register("w", "1", lambda ctx, input: None, concurrency=both)
    handle = start(engine)
    assert sorted(handle.record.tags) == ["borrowed:tenant:a", "concurrency:global", "concurrency:tenant:a"]
    assert count(engine, "concurrency:global") == 1


def test_an_operators_pool_limit_applies(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=1, up_to=10))
    start(engine)
    start(engine)  # creates the pool's row on every store
    if not hasattr(engine.store, "set_limit_override"):
        pytest.skip("store without overrides")
    engine.set_limit_override("global", 1, reason="incident")
    exc = refusal(engine)
    assert (exc.source, exc.pool_limit, exc.pool_active) == ("pool", 1, 1)
    engine.set_limit_override("global", None, reason="over")
    assert "concurrency:global" in start(engine).record.tags


def test_would_admit_answers_as_a_start_does(engine: Engine) -> None:
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=1, up_to=10, pool="other"))
    start(engine), start(engine)
    check = engine.would_admit("w", {"tenant": "a"})
    assert (check.admitted, check.outcome) == (False, "reject")
    assert engine.would_admit("w", {"tenant": "b"}).admitted


def test_a_retried_run_is_admitted_again_as_guaranteed_or_borrowed(engine: Engine) -> None:
    def fail(ctx: Any, input: Any) -> None:
        raise RuntimeError("boom")

    engine.register("w", "1", fail, concurrency=bursting(limit=1, up_to=3))
    first = start(engine)
    second = start(engine)  # borrowed
    engine.execute(second.run_id)
    assert second.refresh().status == RunStatus.FAILED
    assert count(engine, "concurrency:global") == 0
    engine.retry(second.run_id)
    assert count(engine, "concurrency:global") == 1  # first still holds the guarantee: it borrows again
    engine.execute(first.run_id)
    engine.retry(first.run_id)
    assert (count(engine, "concurrency:tenant:a"), count(engine, "concurrency:global")) == (2, 1)


def test_a_child_refused_by_the_pool_fails_its_parent_with_the_pools_figures(engine: Engine) -> None:
    engine.register("child", "1", lambda ctx, input: None, concurrency=bursting(limit=0, up_to=5, pool="other"))

    def parent(ctx: Any, input: Any) -> Any:
        try:
            ctx.child("child", {"tenant": "a"})
        except ChildWorkflowError as exc:
            cause = exc.__cause__
            assert isinstance(cause, ConcurrencyLimitError)
            return {"source": cause.source, "pool": cause.pool, "pool_active": cause.pool_active}
        return None

    engine.register("parent", "1", parent)
    engine.start("child", {"tenant": "a"})  # fills pool "other"
    run = engine.start("parent", {})
    engine.execute(run.run_id)
    assert run.refresh().output == {"source": "pool", "pool": "other", "pool_active": 1}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Concurrency(key="k", limit=1, burst=Burst(pool="global", up_to=0)), "up_to"),
        (lambda: Concurrency(key="k", limit=5, burst=Burst(pool="global", up_to=3)), "at least the limit"),
        (lambda: Concurrency(key="k", burst=Burst(pool="global", up_to=3), strategy=Strategy.GROUP_ROUND_ROBIN), "REJECT"),
        (lambda: Concurrency(key="k", burst=Burst(pool="global", up_to=3), count_statuses=["running"]), "default statuses"),
        (lambda: Concurrency(key="k", burst={"pool": "global"}), "must be a Burst"),  # type: ignore[arg-type]
        (lambda: Burst(pool="", up_to=3), "1 to 200 characters"),
    ],
)
def test_a_bad_burst_is_refused_when_declared(make: Any, message: str) -> None:
    with pytest.raises(InvalidStartError, match=message):
        make()


@pytest.mark.parametrize(
    ("concurrency", "message"),
    [
        (Concurrency(key="k", limit=1, burst=Burst(pool="nowhere", up_to=3)), "names no pool"),
        (Concurrency(key="global", limit=2), "is a pool"),
        (
            [
                Concurrency(key="k", limit=1, burst=Burst(pool="global", up_to=3)),
                Concurrency(key="j", strategy=Strategy.CANCEL_NEWEST),
            ],
            "Strategy.REJECT on every one of its keys",
        ),
    ],
)
def test_a_bad_burst_is_refused_at_start_creating_nothing(engine: Engine, concurrency: Any, message: str) -> None:
    engine.register("w", "1", lambda ctx, input: None)
    with pytest.raises(InvalidStartError, match=message):
        engine.start("w", {}, concurrency=concurrency)
    assert engine.list_runs() == []


@pytest.mark.parametrize(
    ("pools", "bad"),
    [(None, 0), ({"global": 50, "eu": 0}, 0), (["global"], 1), ({"global": "50"}, 1), ({"global": True, "": 3}, 2)],
)
def test_the_pools_setting_is_checked(pools: Any, bad: int) -> None:
    from django.test import override_settings

    from durable import checks

    with override_settings(DURABLE={"POOLS": pools}):
        errors = [m for m in checks.check_settings() if m.id == "durable.E010"]
    assert len(errors) == bad


def test_the_quotas_command_shows_the_burst() -> None:
    import io
    import json

    from django.core.management import call_command

    from durable.runtime import Registry

    engine = Engine(DjangoStore(), dispatch=lambda engine, run: None, registry=Registry())  # the command reads the database
    engine.register("w", "1", lambda ctx, input: None, concurrency=bursting(limit=1, up_to=4))
    start(engine), start(engine)
    out = io.StringIO()
    call_command("durable", "quotas", "--json", stdout=out)
    rows = {row["key"]: row for row in json.loads(out.getvalue())}
    acme, pool = rows["tenant:a"], rows["global"]
    assert (acme["guaranteed"], acme["borrowed"], acme["pool"], acme["pool_active"], acme["up_to"]) == (1, 1, "global", 1, 4)
    assert (pool["is_pool"], pool["active"]) == (True, 1)


@pytest.mark.parametrize(
    "entries",
    [
        [bursting(limit=2, up_to=10), Concurrency(key=tenant, limit=5)],
        [Concurrency(key=tenant, limit=5), bursting(limit=2, up_to=10)],
        [Concurrency(key=tenant, limit=1), bursting(limit=2, up_to=10)],
        [bursting(limit=2, up_to=10), bursting(limit=1, up_to=3, pool="other")],
    ],
    ids=["burst-then-plain", "plain-then-burst", "plain-smaller", "two-bursts"],
)
def test_a_burst_sharing_its_key_with_another_entry_is_refused_creating_nothing(engine: Engine, entries: Any) -> None:
    # "The smaller limit applies" compared limits only: limit=2 with up_to=10 won over a plain
    # limit=5 on the same key, and 10 runs of the tenant were admitted.
    engine.register("w", "1", lambda ctx, input: None, concurrency=entries)
    with pytest.raises(InvalidStartError, match="resolve to the key 'tenant:a' and one has a burst"):
        start(engine)
    assert engine.list_runs() == []
    engine.register(
        "w", "1", lambda ctx, input: None, concurrency=[bursting(limit=2, up_to=10), Concurrency(key="plan", limit=5)]
    )
    assert start(engine).record.tags == ["concurrency:plan", "concurrency:tenant:a"]  # other keys mix as before


def test_the_handle_marks_borrowed_only_the_keys_that_borrowed(engine: Engine) -> None:
    # Two keys with bursts on one pool: tenant:a borrows, user:1 is within its limit. On
    # PostgreSQL the handle marked every burst key on a used pool borrowed.
    both = [
        Concurrency(key="tenant:a", limit=1, burst=Burst(pool="global", up_to=3)),
        Concurrency(key="user:1", limit=3, burst=Burst(pool="global", up_to=3)),
    ]
    engine.register("w", "1", lambda ctx, input: None, concurrency=both)
    engine.start("w", {})
    second = engine.start("w", {})
    expected = ["borrowed:tenant:a", "concurrency:global", "concurrency:tenant:a", "concurrency:user:1"]
    assert sorted(second.record.tags) == expected
    assert (count(engine, "borrowed:tenant:a"), count(engine, "borrowed:user:1"), count(engine, "concurrency:global")) == (
        1,
        0,
        1,
    )


def test_a_busy_pool_inside_a_transaction_answers_503_with_retry_after() -> None:
    exc = PoolBusyError(workflow="w", pools=["global"], attempts=4)
    parts = http.error_parts(exc)
    assert parts is not None
    status, body, headers = parts
    assert (status, body["code"], int(headers["Retry-After"]) >= 1) == (503, "pool_busy", True)
    assert "retry the transaction" in body["detail"]


def test_a_busy_pool_met_by_a_workflow_body_is_durables_infrastructure_not_the_runs_failure() -> None:
    # ctx.start_child inside a transaction: the execution is tried again, as after a database error.
    with pytest.raises(StoreUnavailable) as info, context._store_call():
        raise PoolBusyError(workflow="child", pools=["global"], attempts=4)
    assert isinstance(info.value.__cause__, PoolBusyError)
    with pytest.raises(ConcurrencyLimitError), context._store_call():  # a refusal still passes
        raise ConcurrencyLimitError(workflow="child", key="k", limit=1, active=1)
