"""The broker is down when a start or a cancel commits: the call still succeeds.

The run is committed, so the failed send (or revoke) is logged, never raised;
the sweeper sends the run once the broker is back. These tests point the test
project's Celery app at a closed local port: a real unreachable broker.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone
from rest_framework.test import APIClient

from durable import DjangoStore, Engine, engine, models, tasks
from durable.runtime import Dispatcher
from durable.tasks import CeleryDispatcher
from testproject.celery import app as celery_app
from tests.api.helpers import add_input, cancel_url, start_add

pytestmark = pytest.mark.django_db(transaction=True)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DeadBroker:
    """Celery's broker connections go to a closed port until ``restore()`` (or the test's end)."""

    def __init__(self) -> None:
        self._monkeypatch = monkeypatch = pytest.MonkeyPatch()
        self._saved = celery_app._pool, celery_app.amqp._producer_pool
        # CELERY_BROKER_URL in the environment wins over the app's conf.
        monkeypatch.setenv("CELERY_BROKER_URL", f"redis://127.0.0.1:{_closed_port()}/0")
        celery_app._pool, celery_app.amqp._producer_pool = None, None
        self.down = True

    def restore(self) -> None:
        """First wait for the background publisher to try (and fail) what was started while down."""
        if not self.down:
            return
        assert tasks.publisher.flush(timeout=60)
        self.down = False
        self._monkeypatch.undo()
        if celery_app._pool is not None:
            celery_app._pool.force_close_all()
        celery_app._pool, celery_app.amqp._producer_pool = self._saved


@pytest.fixture
def dead_broker() -> Iterator[DeadBroker]:
    broker = DeadBroker()
    yield broker
    broker.restore()


@pytest.fixture
def queue(settings: Any) -> str:
    """A queue of this test's own, so that no worker of the session consumes its messages."""
    name = f"broker-down-{uuid.uuid4().hex[:8]}"
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": name}
    return name


def sent_task_ids(queue: str) -> list[str]:
    """Drain ``queue`` on the real broker: the task ids of the messages it held."""
    ids: list[str] = []
    with celery_app.connection_for_write() as conn, conn.SimpleQueue(queue) as q:
        while True:
            try:
                message = q.get(timeout=0.5)
            except q.Empty:
                return ids
            ids.append(message.headers["id"])
            message.ack()


def resend_by_sweeper(settings: Any, queue: str, run_id: str) -> None:
    """Once the broker is back, the sweeper sends the pending run (it was never delivered)."""
    settings.DURABLE = {**settings.DURABLE, "REDISPATCH_AFTER": 0}
    undelivered = [r.run_id for r in DjangoStore().undelivered_runs(dispatched_before=[timezone.now()])]
    assert run_id in undelivered
    report = engine.sweep()
    assert run_id in report["undelivered"]
    assert tasks.task_id(run_id, 0) in sent_task_ids(queue)


def test_engine_start_succeeds_and_logs_when_the_broker_is_down(
    dead_broker: DeadBroker, queue: str, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    e = Engine(DjangoStore(), dispatch=CeleryDispatcher())
    autocommit = e.start("test.add", add_input("k"))  # on_commit runs at once
    with transaction.atomic():
        in_atomic = e.start("test.add", add_input("k"))  # on_commit runs after the block
    dead_broker.restore()
    for handle in (autocommit, in_atomic):
        assert handle.created
        assert models.WorkflowRun.objects.get(run_id=handle.run_id).status == "pending"
        assert logged(caplog, handle.run_id, "sweeper")
    resend_by_sweeper(settings, queue, autocommit.run_id)


def test_post_runs_is_201_with_a_pending_run_when_the_broker_is_down(
    dead_broker: DeadBroker, queue: str, settings: Any, caplog: pytest.LogCaptureFixture, admin_user: Any
) -> None:
    api = APIClient()
    api.force_authenticate(admin_user)
    response = start_add(api, "k")
    dead_broker.restore()
    assert response.status_code == 201, response.content
    run_id = response.json()["run_id"]
    assert response.json()["status"] == "pending"
    assert models.WorkflowRun.objects.get(run_id=run_id).status == "pending"
    assert logged(caplog, run_id, "sweeper")
    resend_by_sweeper(settings, queue, run_id)
    # The message the sweeper sent, executed as a worker executes it: the run
    # completes, and it is the only run (the client got its 201, nothing to retry).
    tasks.execute_run.apply(args=(run_id,), task_id=tasks.task_id(run_id, 0))
    run = models.WorkflowRun.objects.get(run_id=run_id)
    assert (run.status, run.output) == ("completed", {"total": 3})
    assert models.WorkflowRun.objects.count() == 1


def test_post_cancel_is_200_when_the_broker_is_down(
    dead_broker: DeadBroker, caplog: pytest.LogCaptureFixture, admin_user: Any
) -> None:
    handle = Engine(DjangoStore(), dispatch=lambda engine, run: None).start("test.add", add_input("k"))
    api = APIClient()
    api.force_authenticate(admin_user)
    response = api.post(cancel_url(handle.run_id))
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "cancelled"
    assert models.WorkflowRun.objects.get(run_id=handle.run_id).status == "cancelled"
    assert logged(caplog, handle.run_id, "revoke")


def logged(caplog: pytest.LogCaptureFixture, run_id: str, words: str) -> bool:
    return any(r.levelname == "ERROR" and run_id in r.getMessage() and words in r.getMessage() for r in caplog.records)


class RevokeFails(Dispatcher):
    """A dispatcher whose revoke raises at once (not on commit), as a broker client would."""

    def revoke(self, engine: Engine, run: Any) -> None:
        raise ConnectionError("broker unreachable")


@pytest.mark.parametrize("store", ["django", "memory"])
def test_a_revoke_that_raises_does_not_fail_the_cancel(store: str, caplog: pytest.LogCaptureFixture) -> None:
    from durable import InMemoryStore

    e = Engine(DjangoStore() if store == "django" else InMemoryStore(), dispatch=RevokeFails())
    parent = e.start("test.add", add_input("k"))
    child = e.start("test.add", add_input("k"), parent_run_id=parent.run_id)
    assert e.cancel(parent.run_id).status == "cancelled"
    assert e.get_run(child.run_id).status == "cancelled"  # the cancel went on to the children
    assert logged(caplog, parent.run_id, "revoke")
