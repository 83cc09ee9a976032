"""The async API (``astart``, ``adispatch``, ``aget_run``, ``alist_runs``, ``acancel``,
``asignal``, ``aemit``, ``arefresh``, ``aresult``) on DjangoStore and InMemoryStore:
each keeps the guarantees of its sync twin, and an async limit function is awaited
on the caller's own task (no thread hop).

The tests drive an event loop with ``asyncio.run``; the database work of the async
calls runs in a thread of its own (``sync_to_async``), on a connection of its own,
hence ``transaction=True``.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from durable import (
    Concurrency,
    ConcurrencyLimitError,
    DjangoStore,
    DurableWorkflow,
    Engine,
    InMemoryStore,
    RunStatus,
    WorkflowContext,
)
from durable.exceptions import InvalidStartError, RunFailedError, RunTerminalError
from durable.runtime import Registry
from tests.unit.conftest import RecordingDispatcher

pytestmark = pytest.mark.django_db(transaction=True)

#: The task of the coroutine that called the async API, as the test sets it.
CALLER: contextvars.ContextVar[asyncio.Task[Any] | None] = contextvars.ContextVar("caller", default=None)


@pytest.fixture(params=["django", "memory"])
def engine(request: pytest.FixtureRequest) -> Engine:
    store = DjangoStore() if request.param == "django" else InMemoryStore()
    return Engine(store, dispatch=RecordingDispatcher(), registry=Registry())


def _noop(ctx: WorkflowContext, input: Any) -> Any:
    return {"echo": input}


def _sleepy(ctx: WorkflowContext, input: Any) -> Any:
    return ctx.wait_for_signal("go")


async def _as_caller(coroutine: Any) -> Any:
    CALLER.set(asyncio.current_task())
    return await coroutine


def run(coroutine: Any) -> Any:
    return asyncio.run(_as_caller(coroutine))


def test_astart_creates_the_run_that_start_would(engine: Engine) -> None:
    engine.register("a.echo", "1", _noop, concurrency=Concurrency(key="k", limit=2))

    handle = run(engine.astart("a.echo", {"n": 1}))

    assert handle.created and handle.status == RunStatus.PENDING
    assert engine.dispatch.sent == [handle.run_id]
    assert engine.get_run(handle.run_id).input == {"n": 1}
    assert run(engine.aget_run(handle.run_id)).run_id == handle.run_id
    assert [h.run_id for h in run(engine.alist_runs(workflow="a.echo"))] == [handle.run_id]
    # An idempotent re-start returns the same run.
    again = run(engine.astart("a.echo", {"n": 1}, run_id=handle.run_id))
    assert again.run_id == handle.run_id and not again.created


def test_a_full_key_refuses_an_async_start_and_creates_nothing(engine: Engine) -> None:
    engine.register("a.echo", "1", _noop, concurrency=Concurrency(key="k", limit=1))
    run(engine.astart("a.echo"))

    with pytest.raises(ConcurrencyLimitError) as refused:
        run(engine.astart("a.echo"))

    assert (refused.value.key, refused.value.limit, refused.value.active) == ("k", 1, 1)
    assert len(engine.list_runs(workflow="a.echo")) == 1


def test_an_async_limit_function_is_awaited_on_the_callers_task(engine: Engine) -> None:
    calls: list[tuple[str, bool]] = []

    async def limit(key: str) -> int:
        # The task that called astart: a thread hop (async_to_sync) would run this in a task of its own.
        calls.append((key, asyncio.current_task() is CALLER.get()))
        return 1

    keys: list[str] = []

    def key(input: dict[str, str]) -> str:
        keys.append(input["t"])
        return input["t"]

    engine.register("a.echo", "1", _noop, concurrency=Concurrency(key=key, limit=limit))

    run(engine.astart("a.echo", {"t": "acme"}))
    with pytest.raises(ConcurrencyLimitError):
        run(engine.astart("a.echo", {"t": "acme"}))
    run(engine.astart("a.echo", {"t": "globex"}))

    assert calls == [("acme", True), ("acme", True), ("globex", True)]
    assert keys == ["acme", "acme", "globex"]  # the key function, once per start
    # The sync start calls the same function too (in a loop of its own).
    with pytest.raises(ConcurrencyLimitError):
        engine.start("a.echo", {"t": "globex"})


@pytest.mark.parametrize(
    ("result", "message"),
    [(2.5, "must be an integer, got 2.5"), (True, "must be an integer, got True"), (2**31, "must be from")],
)
def test_a_bad_async_limit_is_an_invalid_start(engine: Engine, result: Any, message: str) -> None:
    async def limit(key: str) -> Any:
        return result

    engine.register("a.echo", "1", _noop, concurrency=Concurrency(key="k", limit=limit))
    with pytest.raises(InvalidStartError, match=message):
        run(engine.astart("a.echo"))
    assert engine.list_runs() == []


def test_an_async_limit_that_raises_does_not_stop_an_idempotent_restart(engine: Engine) -> None:
    """As with ``start``: a run id that names a run returns it before any quota is resolved."""
    broken = False

    async def limit(key: str) -> int:
        if broken:
            raise RuntimeError("plans service down")
        return 3

    engine.register("a.echo", "1", _noop, concurrency=Concurrency(key="k", limit=limit))
    first = run(engine.astart("a.echo", run_id="order-1"))
    broken = True

    assert run(engine.astart("a.echo", run_id="order-1")).run_id == first.run_id
    with pytest.raises(InvalidStartError, match="limit function raised RuntimeError for key 'k': plans service down"):
        run(engine.astart("a.echo", run_id="order-2"))
    assert [h.run_id for h in engine.list_runs()] == ["order-1"]


def test_adispatch_and_astart_on_a_workflow_class(engine: Engine) -> None:
    class Echo(DurableWorkflow):
        name = "a.class"
        version = "2"
        concurrency = Concurrency(key=lambda i: i["t"], limit=1)

        def run(self, ctx: WorkflowContext, input: Any) -> Any:
            return input

    Echo.engine = engine  # the class registered itself on the default engine; this test's engine gets it too
    engine.register(Echo.name, "2", Echo._execute, Echo.concurrency)

    handle = run(Echo.adispatch({"t": "a"}))
    assert (handle.workflow, handle.version) == ("a.class", "2")
    assert run(Echo.astart({"t": "b"}, run_id="b-1")).run_id == "b-1"
    with pytest.raises(ConcurrencyLimitError):
        run(Echo.adispatch({"t": "a"}))


def test_acancel_and_asignal(engine: Engine) -> None:
    engine.register("a.wait", "1", _sleepy)
    waiting = engine.start("a.wait")
    engine.execute(waiting.run_id)
    assert engine.get_run(waiting.run_id).status == RunStatus.SUSPENDED

    signalled = run(engine.asignal(waiting.run_id, "go", {"ok": True}))
    assert signalled.run_id == waiting.run_id
    engine.execute(waiting.run_id)
    assert engine.get_run(waiting.run_id).output == {"ok": True}

    other = engine.start("a.wait")
    assert run(engine.acancel(other.run_id)).status == RunStatus.CANCELLED
    with pytest.raises(RunTerminalError):
        run(engine.acancel(other.run_id))


def test_aemit_starts_each_subscriber_once_per_event_id(engine: Engine) -> None:
    engine.register("a.on_signup", "1", _noop, on_events=["user.signed_up"])
    engine.register("a.full", "1", _noop, concurrency=Concurrency(key="k", limit=0), on_events=["user.signed_up"])

    first = run(engine.aemit("user.signed_up", {"user": 1}, event_id="e1"))
    again = run(engine.aemit("user.signed_up", {"user": 1}, event_id="e1"))

    assert [h.run_id for h in first.started] == ["event:e1:a.on_signup"]
    assert [s.workflow for s in first.skipped] == ["a.full"]
    assert isinstance(first.skipped[0].error, ConcurrencyLimitError)
    assert again.started == [] and [h.run_id for h in again.duplicates] == ["event:e1:a.on_signup"]
    with pytest.raises(InvalidStartError, match="event name"):
        run(engine.aemit(""))


def test_aresult_waits_without_blocking_the_event_loop(engine: Engine) -> None:
    engine.register("a.echo", "1", _noop)
    engine.register("a.wait", "1", _sleepy)
    done = engine.start("a.echo", {"n": 2})
    never = engine.start("a.wait")

    async def scenario() -> tuple[Any, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.ensure_future(tick())
        # The run finishes while aresult polls it.
        output, _ = await asyncio.gather(done.aresult(timeout=10), sync_to_async(engine.execute)(done.run_id))
        with pytest.raises(TimeoutError, match="is still pending after 0.3s"):
            await never.aresult(timeout=0.3)
        ticker.cancel()
        return output, ticks

    output, ticks = run(scenario())
    assert output == {"echo": {"n": 2}}
    assert ticks >= 20  # the loop went on while aresult waited 0.3 s and more
    assert run(done.arefresh()).status == RunStatus.COMPLETED


def test_aresult_raises_for_a_failed_run(engine: Engine) -> None:
    def fail(ctx: WorkflowContext, input: Any) -> Any:
        raise ValueError("nope")

    engine.register("a.fail", "1", fail)
    handle = engine.start("a.fail")
    engine.execute(handle.run_id)
    with pytest.raises(RunFailedError, match="ended failed: nope"):
        run(handle.aresult(timeout=5))
