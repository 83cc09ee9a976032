"""Executing runs: journaled steps, retries, cancellation, compare-and-set, recovery."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from durable import (
    Concurrency,
    DurableWorkflow,
    Engine,
    FatalError,
    InMemoryStore,
    RunStatus,
)
from durable import (
    engine as default_engine,
)
from durable.exceptions import NonDeterminismError, RunFailedError, RunTerminalError, SignalTimeout
from durable.runtime import Registry, inline_dispatch
from durable.stores import StepEntry
from durable.tasks import CeleryDispatcher

pytestmark = pytest.mark.django_db


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str, value: Any = None) -> Any:
        self.calls.append(name)
        return value


@pytest.fixture
def queued(store: Any) -> Engine:
    """An engine whose runs wait until the test executes them."""
    return Engine(store, dispatch=lambda engine, run: None, registry=Registry())


def test_run_goes_pending_running_completed(queued: Engine) -> None:
    seen: list[str] = []

    def body(ctx: Any, input: Any) -> Any:
        seen.append(queued.get_run(ctx.run_id).status)
        return {"doubled": ctx.step("double", lambda x: 2 * x, input["x"])}

    queued.register("w", "1", body)
    handle = queued.start("w", {"x": 21})
    assert handle.status == RunStatus.PENDING
    queued.execute(handle.run_id)
    assert seen == [RunStatus.RUNNING]
    assert handle.refresh().status == RunStatus.COMPLETED
    assert handle.result(timeout=1) == {"doubled": 42}
    record = handle.record
    assert record.attempt == 1 and record.started_at and record.finished_at


def test_finished_steps_are_not_called_again_on_resume(queued: Engine, store: Any) -> None:
    recorder = Recorder()

    def body(ctx: Any, input: Any) -> Any:
        a = ctx.step("a", recorder, "a", 1)
        b = ctx.step("b", recorder, "b", 2)
        return a + b

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    # A previous execution finished step "a" and then its worker died.
    claimed = store.claim(handle.run_id, lease="dead-worker", worker="w1", stale_before=timezone.now())
    assert store.record_step(handle.run_id, "dead-worker", StepEntry(0, "a", "completed", output=10))
    store.transition(handle.run_id, from_statuses=["running"], to="pending")
    assert claimed is not None
    queued.execute(handle.run_id)
    assert recorder.calls == ["b"]
    assert handle.result(timeout=1) == 12
    assert handle.record.attempt == 2


def test_a_claim_with_its_journal_reads_what_get_run_and_load_steps_read(queued: Engine, store: Any) -> None:
    queued.register("w", "1", lambda ctx, input: None, Concurrency(key="tenant:a", limit=5))
    parent = queued.start("w", {})
    handle = queued.start("w", {"n": 1.5, "s": ["x", None]}, parent_run_id=parent.run_id)
    # A previous execution journaled two steps (the second replacing its waiting entry) and died.
    assert store.claim(handle.run_id, lease="dead", worker="w1", stale_before=timezone.now())
    assert store.record_step(handle.run_id, "dead", StepEntry(0, "a", "completed", output={"v": [1, "b"]}))
    assert store.record_step(handle.run_id, "dead", StepEntry(1, "durable.sleep", "waiting", output={"until": "x"}))
    started = timezone.now()
    failed = StepEntry(1, "b", "failed", error={"type": "E"}, attempts=2, started_at=started)
    assert store.record_step(handle.run_id, "dead", failed)
    assert not store.record_step(handle.run_id, "other", StepEntry(2, "c", "completed"))  # not its lease: nothing written
    assert not store.finish(handle.run_id, "other", status=RunStatus.COMPLETED)
    claimed = store.claim_journal(handle.run_id, lease="new", worker="w2", stale_before=timezone.now() + timedelta(hours=1))
    assert claimed is not None
    record, steps = claimed
    assert record == store.get_run(handle.run_id)
    assert (record.status, record.lease, record.worker, record.attempt) == (RunStatus.RUNNING, "new", "w2", 2)
    assert record.parent_run_id == parent.run_id and record.input == {"n": 1.5, "s": ["x", None]}
    assert record.started_at is not None and record.heartbeat_at is not None and record.redispatches == 0
    assert store.count_runs(tag="concurrency:tenant:a", statuses=[RunStatus.RUNNING]) == 1  # the tag mirrors it
    if steps is not None:  # read with the claim (PostgreSQL): what load_steps reads
        assert steps == store.load_steps(handle.run_id)
    journal = [(s.name, s.outcome, s.attempts) for s in store.load_steps(handle.run_id)]
    assert journal == [("a", "completed", 1), ("b", "failed", 2)]
    assert store.load_steps(handle.run_id)[1].started_at == started
    # A live run is not claimed again; a finish on the lease ends it and mirrors the tags.
    assert store.claim_journal(handle.run_id, lease="x", worker="w3", stale_before=timezone.now() - timedelta(hours=1)) is None
    assert store.finish(handle.run_id, "new", status=RunStatus.COMPLETED, output=None)
    assert store.count_runs(tag="concurrency:tenant:a", statuses=[RunStatus.COMPLETED]) == 1
    done = store.get_run(handle.run_id)
    assert (done.status, done.lease, done.output) == (RunStatus.COMPLETED, "", None) and done.finished_at is not None
    assert not store.record_step(handle.run_id, "new", StepEntry(2, "c", "completed"))  # ended: nothing written
    assert len(store.load_steps(handle.run_id)) == 2


def test_step_retries_with_backoff_then_succeeds(queued: Engine, store: Any) -> None:
    attempts: list[int] = []
    delays: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("model busy")
        return "ok"

    queued.register("w", "1", lambda ctx, input: ctx.step("call", flaky, retries=2, backoff=lambda n: delays.append(n) or 0))
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert handle.result(timeout=1) == "ok"
    assert delays == [1, 2]
    [step] = store.load_steps(handle.run_id)
    assert (step.name, step.outcome, step.attempts) == ("call", "completed", 3)


def test_step_fails_after_its_retries(queued: Engine) -> None:
    calls: list[int] = []

    def always() -> None:
        calls.append(1)
        raise ValueError("bad answer")

    queued.register("w", "1", lambda ctx, input: ctx.step("call", always, retries=1, backoff=0))
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    with pytest.raises(RunFailedError, match="bad answer") as info:
        handle.result(timeout=1)
    assert info.value.status == RunStatus.FAILED
    assert handle.error["type"] == "builtins.ValueError"
    assert len(calls) == 2


def test_fatal_error_is_never_retried(queued: Engine) -> None:
    calls: list[int] = []

    def fatal() -> None:
        calls.append(1)
        raise FatalError("card declined")

    queued.register("w", "1", lambda ctx, input: ctx.step("charge", fatal, retries=5, backoff=0))
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.FAILED
    assert calls == [1]
    assert "card declined" in handle.error["message"]


def test_failed_step_is_replayed_as_a_failure_the_workflow_can_catch(queued: Engine) -> None:
    calls: list[str] = []

    def body(ctx: Any, input: Any) -> Any:
        try:
            ctx.step("charge", lambda: calls.append("charge") or (_ for _ in ()).throw(FatalError("declined")))
        except Exception as exc:  # noqa: BLE001
            return {"caught": type(exc).__name__}
        return {"caught": None}

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert handle.result(timeout=1) == {"caught": "FatalError"}
    assert calls == ["charge"]


def test_step_result_must_be_json(queued: Engine) -> None:
    queued.register("w", "1", lambda ctx, input: ctx.step("s", lambda: {1, 2}, retries=3, backoff=0))
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.FAILED
    assert "must be a JSON value" in handle.error["message"]


def test_replay_meeting_another_step_fails_with_non_determinism(queued: Engine, store: Any) -> None:
    queued.register("w", "1", lambda ctx, input: ctx.step("renamed", lambda: 1))
    handle = queued.start("w", {})
    store.claim(handle.run_id, lease="old", worker="w1", stale_before=timezone.now())
    store.record_step(handle.run_id, "old", StepEntry(0, "original", "completed", output=1))
    store.transition(handle.run_id, from_statuses=["running"], to="pending")
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.FAILED
    assert handle.error["type"] == f"{NonDeterminismError.__module__}.NonDeterminismError"
    assert "'original'" in handle.error["message"] and "'renamed'" in handle.error["message"]


def test_duplicate_delivery_changes_nothing(queued: Engine) -> None:
    recorder = Recorder()
    queued.register("w", "1", lambda ctx, input: ctx.step("s", recorder, "s", 1))
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    queued.execute(handle.run_id)  # the same message delivered again
    assert recorder.calls == ["s"]
    assert handle.refresh().record.attempt == 1


def test_execution_of_a_live_running_run_is_skipped(queued: Engine, store: Any) -> None:
    recorder = Recorder()
    queued.register("w", "1", lambda ctx, input: ctx.step("s", recorder, "s", 1))
    handle = queued.start("w", {})
    assert store.claim(handle.run_id, lease="live", worker="w1", stale_before=timezone.now() - timedelta(hours=1))
    queued.execute(handle.run_id)  # heartbeat is fresh: another worker owns it
    assert recorder.calls == []
    assert handle.refresh().record.lease == "live"


@pytest.mark.django_db(transaction=True)
def test_cancel_frees_the_slot_at_once_and_stops_at_the_next_step(store: Any) -> None:
    engine = Engine(store, dispatch=lambda engine, run: None, registry=Registry())
    in_step = threading.Event()
    release = threading.Event()
    recorder = Recorder()

    def slow() -> str:
        in_step.set()
        release.wait(5)
        return "slow done"

    def body(ctx: Any, input: Any) -> Any:
        ctx.step("slow", slow)
        ctx.step("after", recorder, "after")
        return "finished"

    engine.register("w", "1", body, concurrency=Concurrency(key="k", limit=1))
    handle = engine.start("w", {})

    def execute() -> None:
        try:
            engine.execute(handle.run_id)
        finally:
            connection.close()

    worker = threading.Thread(target=execute)
    worker.start()
    try:
        assert in_step.wait(5)
        assert handle.cancel().status == RunStatus.CANCELLED
        # The slot is free now, while the cancelled step is still running.
        assert engine.start("w", {}).created
    finally:
        release.set()
        worker.join(10)
    assert recorder.calls == []
    assert handle.refresh().status == RunStatus.CANCELLED
    with pytest.raises(RunTerminalError):
        handle.cancel()


def test_result_times_out(queued: Engine) -> None:
    queued.register("w", "1", lambda ctx, input: None)
    handle = queued.start("w", {})
    with pytest.raises(TimeoutError, match="still pending"):
        handle.result(timeout=0.05)


def test_retry_restarts_a_failed_run_under_its_quota(queued: Engine) -> None:
    outcomes = iter([ValueError("first time"), None])

    def maybe() -> str:
        error = next(outcomes)
        if error:
            raise error
        return "ok"

    queued.register("w", "1", lambda ctx, input: ctx.step("s", maybe), concurrency=Concurrency(key="k", limit=1))
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.FAILED
    blocker = queued.start("w", {})
    with pytest.raises(Exception, match="Concurrency limit reached"):
        queued.retry(handle.run_id)
    blocker.cancel()
    assert queued.retry(handle.run_id).status == RunStatus.PENDING
    queued.execute(handle.run_id)
    assert handle.result(timeout=1) == "ok"


def test_sweep_redispatches_orphaned_and_undelivered_runs(store: Any, settings: Any) -> None:
    sent: list[str] = []
    engine = Engine(store, dispatch=lambda engine, run: sent.append(run.run_id), registry=Registry())
    engine.register("w", "1", lambda ctx, input: None)
    orphan = engine.start("w", {})
    lost = engine.start("w", {})
    fresh = engine.start("w", {})
    sent.clear()
    past = timezone.now() - timedelta(seconds=60)
    store.claim(orphan.run_id, lease="gone", worker="w1", stale_before=timezone.now())
    store.transition(orphan.run_id, from_statuses=["running"], to="running", heartbeat_at=past)
    store.transition(lost.run_id, from_statuses=["pending"], to="pending", dispatched_at=past)
    result = engine.sweep()
    assert (result["orphaned"], result["undelivered"]) == ([orphan.run_id], [lost.run_id])
    assert result["promoted"] == result["woken"] == result["blocked"] == []
    assert sorted(sent) == sorted([orphan.run_id, lost.run_id])
    assert fresh.run_id not in sent
    # The orphan is taken over by the next execution.
    engine.execute(orphan.run_id)
    assert orphan.refresh().status == RunStatus.COMPLETED
    assert orphan.record.attempt == 2


def test_run_is_dead_after_max_attempts(store: Any, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "MAX_ATTEMPTS": 2}
    engine = Engine(store, dispatch=lambda engine, run: None, registry=Registry())
    engine.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key="k", limit=1))
    handle = engine.start("w", {})
    for n in range(2):  # two workers died while running it
        store.claim(handle.run_id, lease=f"l{n}", worker="w", stale_before=timezone.now())
        store.transition(handle.run_id, from_statuses=["running"], to="pending")
    engine.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.DEAD
    assert "Gave up after 2 attempts" in handle.error["message"]
    assert engine.start("w", {}).created  # the slot is free


def test_inline_dispatch_executes_at_start() -> None:
    engine = Engine(InMemoryStore(), dispatch=inline_dispatch, registry=Registry())
    engine.register("w", "1", lambda ctx, input: ctx.step("s", lambda: input["n"] + 1))
    assert engine.start("w", {"n": 1}).result(timeout=1) == 2


def test_a_plain_function_is_a_dispatcher_that_only_sends() -> None:
    sent: list[str] = []
    engine = Engine(InMemoryStore(), dispatch=lambda engine, run: sent.append(run.run_id), registry=Registry())
    engine.register("w", "1", lambda ctx, input: ctx.sleep(60))
    handle = engine.start("w", {})
    assert sent == [handle.run_id]
    assert engine.dispatch.live_queues() is None  # no workers to ask: never blocked
    engine.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.SUSPENDED  # no timer sent; the sweeper wakes it
    assert engine.cancel(handle.run_id).status == RunStatus.CANCELLED  # nothing to revoke


def test_engines_built_without_a_dispatcher_send_to_celery() -> None:
    assert isinstance(default_engine.dispatch, CeleryDispatcher)
    assert isinstance(Engine(InMemoryStore()).dispatch, CeleryDispatcher)
    with pytest.raises(TypeError, match="Dispatcher or a function"):
        Engine(InMemoryStore(), dispatch="celery")  # type: ignore[arg-type]


def test_ctx_now_is_journaled(queued: Engine, store: Any) -> None:
    queued.register("w", "1", lambda ctx, input: ctx.now().isoformat())
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    [step] = store.load_steps(handle.run_id)
    assert step.name == "durable.now"
    assert handle.result(timeout=1) == step.output


def test_workflow_class_must_declare_name_and_run() -> None:
    with pytest.raises(TypeError, match="must set a workflow `name`"):

        class NoName(DurableWorkflow):
            def run(self, ctx: Any, input: Any) -> None: ...

    with pytest.raises(TypeError, match="must define run"):

        class NoRun(DurableWorkflow):
            name = "test.norun"


def test_workflows_modules_are_autodiscovered() -> None:
    definition = default_engine.registry.current("chat.turn")
    assert definition.version == "1"
    assert definition.concurrency[0].limit == 8


def test_retry_runs_again_the_failure_that_ended_the_run_and_keeps_the_caught_ones(queued: Engine) -> None:
    calls: list[str] = []
    failing = {"flaky", "save"}

    def call(name: str) -> str:
        calls.append(name)
        if name in failing:
            raise ValueError(f"{name} is down")
        return name

    def body(ctx: Any, input: Any) -> Any:
        try:
            first = ctx.step("flaky", call, "flaky")
        except ValueError:
            first = ctx.step("fallback", call, "fallback")  # the run took this branch
        with contextlib.suppress(SignalTimeout):  # a caught timeout is a failed journal entry too
            ctx.wait_for_signal("approval", timeout=0)
        return [first, ctx.step("save", call, "save")]

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.FAILED
    assert calls == ["flaky", "fallback", "save"]
    failing.clear()  # flaky would succeed now: the retry must not take that branch
    queued.retry(handle.run_id)
    queued.execute(handle.run_id)
    assert handle.result(timeout=1) == ["fallback", "save"]
    assert calls == ["flaky", "fallback", "save", "save"]  # only the step that ended the run ran again
    outcomes = [(s.name, s.outcome) for s in queued.store.load_steps(handle.run_id)]
    assert outcomes == [
        ("flaky", "failed"),
        ("fallback", "completed"),
        ("durable.signal:approval", "failed"),
        ("save", "completed"),
    ]


def test_retry_runs_again_a_failed_step_the_workflow_handled_by_failing(queued: Engine) -> None:
    calls: list[str] = []

    def call() -> str:
        calls.append("call")
        if len(calls) == 1:
            raise ValueError("down")
        return "ok"

    def body(ctx: Any, input: Any) -> Any:
        try:
            return ctx.step("s", call)
        except ValueError as exc:
            raise RuntimeError("giving up") from exc  # the step's failure ends the run, as another error

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    assert handle.refresh().record.error["message"] == "giving up"
    queued.retry(handle.run_id)
    queued.execute(handle.run_id)
    assert handle.result(timeout=1) == "ok"
    assert calls == ["call", "call"]


def test_retry_of_a_cancelled_run_keeps_the_failures_it_caught(queued: Engine) -> None:
    calls: list[str] = []

    def call() -> str:
        calls.append("call")
        raise ValueError("down")

    def body(ctx: Any, input: Any) -> Any:
        with contextlib.suppress(ValueError):
            ctx.step("s", call)
        ctx.wait_for_signal("go")
        return "done"

    queued.register("w", "1", body)
    handle = queued.start("w", {})
    queued.execute(handle.run_id)
    handle.cancel()
    queued.retry(handle.run_id)
    queued.execute(handle.run_id)
    queued.signal(handle.run_id, "go")
    queued.execute(handle.run_id)
    assert handle.result(timeout=1) == "done"
    assert calls == ["call"]


def test_retry_takes_the_quota_checked_now_not_a_stale_tag(queued: Engine) -> None:
    queued.register("w", "1", lambda ctx, input: None)
    override = Concurrency(key="tenant:a", limit=1)
    handle = queued.start("w", {}, concurrency=override)
    handle.cancel()
    queued.start("w", {}, concurrency=override)  # tenant:a is full again
    with pytest.raises(Exception, match="Concurrency limit reached"):
        queued.retry(handle.run_id, concurrency=override)
    retried = queued.retry(handle.run_id)  # the workflow's own quota: none
    assert retried.status == RunStatus.PENDING
    assert queued.count_runs(tag="concurrency:tenant:a", statuses=["pending"]) == 1


def test_retry_of_an_unfinished_run_is_refused_before_the_quota(queued: Engine) -> None:
    queued.register("w", "1", lambda ctx, input: None, concurrency=Concurrency(key="k", limit=1))
    handle = queued.start("w", {})
    with pytest.raises(RunTerminalError, match="is pending"):
        queued.retry(handle.run_id)
