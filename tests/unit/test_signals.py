"""durable.signals: each sent once, after commit, never on a rollback, with its documented
arguments; a receiver that raises fails nothing. Failed runs: ERROR log with the
traceback, and the traceback stored in ``error`` (truncated to TRACEBACK_LIMIT)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import transaction
from django.dispatch import Signal

from durable import Concurrency, ConcurrencyLimitError, DjangoStore, Engine, RunStatus, Strategy, signals
from durable import engine as default_engine
from durable.exceptions import ConcurrencyQueueFullError
from durable.runtime import Registry
from durable.util import format_traceback

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit runs at the commit, as in production

Calls = list[tuple[Any, dict[str, Any]]]
ALL = (signals.run_started, signals.run_finished, signals.step_finished, signals.start_refused, signals.window_skipped)


@pytest.fixture
def listen() -> Iterator[Callable[[Signal], Calls]]:
    """``listen(signal)`` connects a receiver recording ``(sender, kwargs)``; disconnected after the test."""
    connected: list[tuple[Signal, Callable[..., None]]] = []

    def connect(signal: Signal) -> Calls:
        calls: Calls = []

        def receiver(sender: Any, **kwargs: Any) -> None:
            kwargs.pop("signal")
            calls.append((sender, kwargs))

        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))
        return calls

    yield connect
    for signal, receiver in connected:
        signal.disconnect(receiver)


@pytest.fixture
def queued(store: Any) -> Engine:
    """An engine whose runs wait until the test executes them."""
    return Engine(store, dispatch=lambda engine, run: None, registry=Registry())


def add(a: int, b: int) -> int:
    return a + b


def explode(message: str) -> None:
    raise ValueError(message)


def test_a_run_sends_run_started_step_finished_and_run_finished_once(queued: Engine, listen: Any) -> None:
    started, steps, finished = listen(signals.run_started), listen(signals.step_finished), listen(signals.run_finished)

    def body(ctx: Any, input: Any) -> Any:
        return {"sum": ctx.step("add", add, 1, 2), "twice": ctx.step("again", add, 3, 4)}

    queued.register("w", "1", body)
    handle = queued.start("w", {"x": 1})
    assert (started, steps, finished) == ([], [], [])  # created, not executed yet
    queued.execute(handle.run_id)
    queued.execute(handle.run_id)  # a duplicate delivery changes nothing and sends nothing

    assert len(started) == 1
    sender, kwargs = started[0]
    assert sender is queued
    assert kwargs == {
        "run_id": handle.run_id,
        "workflow": "w",
        "version": "1",
        "namespace": "default",
        "generation": 0,
        "started_at": kwargs["started_at"],
    }
    assert isinstance(kwargs["started_at"], datetime)

    assert [(k["step"], k["position"], k["outcome"], k["output"], k["attempts"]) for _, k in steps] == [
        ("add", 0, "completed", 3, 1),
        ("again", 1, "completed", 7, 1),
    ]
    assert set(steps[0][1]) == {
        "run_id",
        "workflow",
        "namespace",
        "step",
        "position",
        "outcome",
        "attempts",
        "output",
        "error",
        "started_at",
        "finished_at",
        "duration",
    }
    assert all(k["run_id"] == handle.run_id and k["error"] is None and k["duration"] >= 0 for _, k in steps)

    assert len(finished) == 1
    sender, kwargs = finished[0]
    assert sender is queued
    assert kwargs["status"] == RunStatus.COMPLETED and kwargs["output"] == {"sum": 3, "twice": 7}
    assert (kwargs["run_id"], kwargs["workflow"], kwargs["version"], kwargs["namespace"]) == (handle.run_id, "w", "1", "default")
    assert kwargs["error"] is None and kwargs["started_at"] == started[0][1]["started_at"]
    assert kwargs["finished_at"] >= kwargs["started_at"] and kwargs["duration"] >= 0


def test_a_resumed_run_sends_run_started_once(queued: Engine, listen: Any) -> None:
    started, finished = listen(signals.run_started), listen(signals.run_finished)

    def body(ctx: Any, input: Any) -> Any:
        return ctx.wait_for_signal("go")

    queued.register("w", "1", body)
    handle = queued.start("w")
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.SUSPENDED
    assert (len(started), finished) == (1, [])
    queued.signal(handle.run_id, "go", {"ok": True})
    queued.execute(handle.run_id)
    assert handle.refresh().status == RunStatus.COMPLETED
    assert len(started) == 1
    assert [k["status"] for _, k in finished] == [RunStatus.COMPLETED]


def test_a_failed_run_logs_an_error_with_its_traceback_and_stores_it(queued: Engine, listen: Any, caplog: Any) -> None:
    steps, finished = listen(signals.step_finished), listen(signals.run_finished)

    def body(ctx: Any, input: Any) -> Any:
        return ctx.step("explode", explode, "the disk is full")

    queued.register("w", "1", body)
    handle = queued.start("w")
    with caplog.at_level(logging.INFO, logger="durable"):
        queued.execute(handle.run_id)

    handle.refresh()
    assert handle.status == RunStatus.FAILED
    error = handle.error
    assert (error["type"], error["message"]) == ("builtins.ValueError", "the disk is full")
    assert error["traceback"].startswith("Traceback (most recent call last):")
    assert "in explode" in error["traceback"] and error["traceback"].endswith("ValueError: the disk is full\n")

    failures = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "durable.runtime.execution"]
    assert len(failures) == 1
    assert handle.run_id in failures[0].getMessage() and "the disk is full" in failures[0].getMessage()
    assert failures[0].exc_info is not None and failures[0].exc_info[0] is ValueError

    assert [(k["step"], k["outcome"]) for _, k in steps] == [("explode", "failed")]
    step_traceback = steps[0][1]["error"]["traceback"]  # from the step down; the run's adds the body's frames above
    assert "in explode" in step_traceback and error["traceback"].endswith(step_traceback.split("\n", 1)[1])
    assert [(k["status"], k["error"]) for _, k in finished] == [(RunStatus.FAILED, error)]


def test_a_retried_run_sends_run_started_again(queued: Engine, listen: Any) -> None:
    started, finished = listen(signals.run_started), listen(signals.run_finished)
    attempts = []

    def body(ctx: Any, input: Any) -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("first time")
        return "ok"

    queued.register("w", "1", body)
    handle = queued.start("w")
    queued.execute(handle.run_id)
    queued.retry(handle.run_id)
    assert handle.refresh().record.started_at is None  # the retry's first claim sets it again
    queued.execute(handle.run_id)
    assert [k["generation"] for _, k in started] == [0, 1]
    assert [k["status"] for _, k in finished] == [RunStatus.FAILED, RunStatus.COMPLETED]


def test_a_cancel_sends_run_finished_cancelled(queued: Engine, listen: Any) -> None:
    finished = listen(signals.run_finished)
    queued.register("w", "1", lambda ctx, input: None)
    handle = queued.start("w")
    queued.cancel(handle.run_id)
    [(sender, kwargs)] = finished
    assert sender is queued
    assert (kwargs["status"], kwargs["error"]["type"], kwargs["started_at"], kwargs["duration"]) == (
        RunStatus.CANCELLED,
        "durable.cancelled",
        None,
        None,
    )


def test_a_refused_start_sends_start_refused(queued: Engine, listen: Any) -> None:
    refused, created = listen(signals.start_refused), listen(signals._run_created)
    queued.register("w", "1", lambda ctx, input: None, Concurrency(key="tenant:acme", limit=1))
    first = queued.start("w")
    with pytest.raises(ConcurrencyLimitError) as raised:
        queued.start("w", run_id="second")
    [(sender, kwargs)] = refused
    assert sender is queued
    assert kwargs == {
        "workflow": "w",
        "key": "tenant:acme",
        "limit": 1,
        "active": 1,
        "namespace": "default",
        "run_id": "second",
        "error": raised.value,
    }
    assert [(k["run_id"], k["status"]) for _, k in created] == [(first.run_id, RunStatus.PENDING)]


def test_a_full_queue_sends_start_refused_and_a_queued_start_is_created_queued(queued: Engine, listen: Any) -> None:
    refused, created = listen(signals.start_refused), listen(signals._run_created)
    spec = Concurrency(key="k", limit=1, strategy=Strategy.GROUP_ROUND_ROBIN, max_queued=1)
    queued.register("w", "1", lambda ctx, input: None, spec)
    queued.start("w")
    queued.start("w")
    with pytest.raises(ConcurrencyQueueFullError):
        queued.start("w")
    assert [k["status"] for _, k in created] == [RunStatus.PENDING, RunStatus.QUEUED]
    assert [(k["key"], type(k["error"])) for _, k in refused] == [("k", ConcurrencyQueueFullError)]


def test_a_start_created_cancelled_sends_run_finished(queued: Engine, listen: Any) -> None:
    created, finished = listen(signals._run_created), listen(signals.run_finished)
    queued.register("w", "1", lambda ctx, input: None, Concurrency(key="k", limit=1, strategy=Strategy.CANCEL_NEWEST))
    queued.start("w")
    newest = queued.start("w")
    assert newest.status == RunStatus.CANCELLED
    assert [k["status"] for _, k in created] == [RunStatus.PENDING, RunStatus.CANCELLED]
    assert [(k["run_id"], k["status"], k["duration"]) for _, k in finished] == [(newest.run_id, RunStatus.CANCELLED, None)]


def test_signals_wait_for_the_commit_and_a_rollback_sends_none(listen: Any) -> None:
    engine = Engine(DjangoStore(), dispatch=lambda engine, run: None, registry=Registry())
    engine.register("w", "1", lambda ctx, input: ctx.step("add", add, 1, 1))
    created, started = listen(signals._run_created), listen(signals.run_started)
    steps, finished = listen(signals.step_finished), listen(signals.run_finished)

    with transaction.atomic():
        handle = engine.start("w")
        assert created == []  # not before the commit
    assert [k["run_id"] for _, k in created] == [handle.run_id]

    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        engine.start("w", run_id="rolled-back")
        engine.execute(handle.run_id)
        assert handle.refresh().status == RunStatus.COMPLETED  # inside the transaction
        engine.cancel(engine.start("w").run_id)
        raise Rollback
    assert len(created) == 1 and (started, steps, finished) == ([], [], [])
    assert handle.refresh().status == RunStatus.PENDING

    with transaction.atomic():
        engine.execute(handle.run_id)
        assert (started, steps, finished) == ([], [], [])
    assert (len(started), len(steps), len(finished)) == (1, 1, 1)


def test_a_receiver_that_raises_fails_no_run_and_no_start(queued: Engine, listen: Any, caplog: Any) -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("the receiver is broken")

    for signal in (*ALL, signals._run_created):
        signal.connect(broken)
    try:
        queued.register("w", "1", lambda ctx, input: ctx.step("add", add, 2, 2), Concurrency(key="k", limit=1))
        handle = queued.start("w")
        with pytest.raises(ConcurrencyLimitError):  # the refusal, not the receiver's error
            queued.start("w")
        queued.execute(handle.run_id)
        assert handle.refresh().status == RunStatus.COMPLETED and handle.output == 4
        other = queued.start("w")
        queued.cancel(other.run_id)
    finally:
        for signal in (*ALL, signals._run_created):
            signal.disconnect(broken)
    failures = [r for r in caplog.records if r.name == "durable.signals" and r.levelno == logging.ERROR]
    names = {r.args[0] for r in failures}  # type: ignore[index]
    assert names == {"_run_created", "start_refused", "run_started", "step_finished", "run_finished"}
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in failures)


def test_receivers_connected_to_another_sender_are_not_called(queued: Engine, listen: Any) -> None:
    calls: Calls = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        calls.append((sender, kwargs))

    signals.run_finished.connect(receiver, sender=default_engine)
    try:
        queued.register("w", "1", lambda ctx, input: None)
        queued.execute(queued.start("w").run_id)
    finally:
        signals.run_finished.disconnect(receiver, sender=default_engine)
    assert calls == []


# -- tracebacks ---------------------------------------------------------------------------


def _deep(n: int) -> None:
    if n == 0:
        raise KeyError("bottom")
    _deeper(n - 1)


def _deeper(n: int) -> None:
    _deep(n)  # alternating frames: Python does not fold them into "[Previous line repeated]"


def test_a_long_traceback_keeps_its_end_within_the_limit() -> None:
    try:
        _deep(60)
    except KeyError as exc:
        full = format_traceback(exc, limit=10**6)
        cut = format_traceback(exc, limit=500)
        nothing = format_traceback(exc, limit=0)
    assert len(full) > 2000 and len(cut) <= 500
    assert cut.startswith("[traceback truncated: its first ") and cut.endswith("KeyError: 'bottom'\n")
    omitted = int(cut.split("its first ")[1].split(" ")[0])
    assert full.endswith(cut.split("\n", 1)[1]) and omitted + len(cut.split("\n", 1)[1]) == len(full)
    assert nothing == ""


def test_the_traceback_limit_is_a_setting(queued: Engine, settings: Any) -> None:
    queued.register("w", "1", lambda ctx, input: _deep(40))
    settings.DURABLE = {**settings.DURABLE, "TRACEBACK_LIMIT": 300}
    handle = queued.start("w")
    queued.execute(handle.run_id)
    traceback = handle.refresh().error["traceback"]
    assert len(traceback) <= 300 and traceback.endswith("KeyError: 'bottom'\n")

    settings.DURABLE = {**settings.DURABLE, "TRACEBACK_LIMIT": 0}
    handle = queued.start("w")
    queued.execute(handle.run_id)
    assert "traceback" not in handle.refresh().error and handle.error["type"] == "builtins.KeyError"


def test_a_traceback_with_nul_and_lone_surrogates_is_stored(queued: Engine) -> None:
    def body(ctx: Any, input: Any) -> Any:
        raise ValueError("nul \x00 and \ud800 here")

    queued.register("w", "1", body)
    handle = queued.start("w")
    queued.execute(handle.run_id)
    handle.refresh()
    assert handle.status == RunStatus.FAILED
    assert "\\x00" in handle.error["traceback"] and "\\ud800" in handle.error["traceback"]
    assert handle.error["message"] == "nul \\x00 and \\ud800 here"  # escaped, as in the traceback


# -- schedules ---------------------------------------------------------------------------


def test_a_skipped_window_sends_window_skipped(listen: Any) -> None:
    from durable import models, schedules

    skipped = listen(signals.window_skipped)
    schedule = schedules.create_schedule(
        "digest", "test.add", {"a": 1, "b": 2}, cron="0 9 * * *", concurrency_key="sched:digest", concurrency_limit=0
    )
    firing = schedules.fire(schedule.pk, now=datetime(2026, 3, 10, 9, 1, tzinfo=UTC))
    assert firing is not None and firing.outcome is schedules.Outcome.SKIPPED
    [(sender, kwargs)] = skipped
    assert sender is models.Schedule
    assert kwargs["schedule"].pk == schedule.pk and kwargs["run_id"] == firing.run_id
    assert kwargs["window"] == datetime(2026, 3, 10, 9, 0, tzinfo=UTC) and kwargs["reason"] == firing.error
    assert kwargs["manual"] is False and isinstance(kwargs["error"], ConcurrencyLimitError)

    manual = schedules.run_now(schedule)
    assert manual.outcome is schedules.Outcome.SKIPPED
    assert [k["manual"] for _, k in skipped] == [False, True]

    with pytest.raises(ZeroDivisionError), transaction.atomic():
        schedules.fire(schedule.pk, now=datetime(2026, 3, 11, 9, 1, tzinfo=UTC))
        1 / 0  # noqa: B018
    assert len(skipped) == 2  # rolled back: nothing sent
