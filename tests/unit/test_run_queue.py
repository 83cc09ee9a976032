"""``engine.start(..., queue=...)``: the Celery queue of one run, on both stores."""

from __future__ import annotations

import pytest

from durable import Engine, RunStatus
from durable.exceptions import InvalidStartError
from tests.unit.conftest import RecordingDispatcher

pytestmark = pytest.mark.django_db


def test_a_start_may_name_its_runs_queue(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: "done")
    default, routed = engine.start("w", {}), engine.start("w", {}, queue="emails")

    assert (default.record.queue, routed.record.queue) == ("", "emails")
    assert engine.get_run(routed.run_id).record.queue == "emails"  # stored, for every later message
    assert engine.start("w", {}, queue="").record.queue == ""


def test_a_run_on_a_queue_without_a_worker_is_blocked_then_goes(engine: Engine, dispatcher: RecordingDispatcher) -> None:
    engine.register("w", "1", lambda ctx, input: "done")
    handle = engine.start("w", {}, queue="emails")
    assert engine.executor.check_remote_queues(live_queues=["celery"]) == ([handle.run_id], [])
    assert handle.refresh().status == RunStatus.BLOCKED
    dispatcher.sent.clear()
    assert engine.executor.check_remote_queues(live_queues=["emails"]) == ([], [handle.run_id])
    assert handle.refresh().status == RunStatus.PENDING
    assert dispatcher.sent == [handle.run_id]


def test_a_remote_workflow_keeps_its_own_queue(engine: Engine) -> None:
    engine.register_remote("billing.charge", "1", queue="billing")
    assert engine.start("billing.charge", {}, queue="emails").record.queue == "billing"


@pytest.mark.parametrize("queue", [3, "x" * 201, "a\x00b"])
def test_a_bad_queue_is_refused_and_creates_nothing(engine: Engine, queue: object) -> None:
    engine.register("w", "1", lambda ctx, input: "done")
    with pytest.raises(InvalidStartError, match="queue name"):
        engine.start("w", {}, queue=queue)  # type: ignore[arg-type]
    assert engine.list_runs() == []
