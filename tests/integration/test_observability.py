"""Observability on the real paths: receivers add no statement to the hot paths, a
signal is sent once when deliveries race (PostgreSQL), and the Celery task of a
failed run succeeds while the failure is logged at ERROR with its traceback."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from durable import Concurrency, Engine, RunStatus, signals
from durable import engine as default_engine
from durable import tasks as durable_tasks
from durable.runtime import Registry
from tests.integration.test_queries import ONE_STEP_RUN, start_queries
from tests.queries import one_step_run_statements, statements
from tests.threads import started

EVERY = (
    signals.run_started,
    signals.run_finished,
    signals.step_finished,
    signals.start_refused,
    signals.window_skipped,
    signals._run_created,
)


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every signal listened to; what each receiver got, as (signal name, kwargs)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()
    receivers = []
    for signal in EVERY:
        name = signals._NAMES[id(signal)]

        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            with lock:
                calls.append((name, kwargs))

        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield calls
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def _engine() -> Engine:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None, Concurrency(key=lambda i: i["key"], limit=100))
    return Engine(dispatch=lambda engine, run: None, registry=registry)


@pytest.mark.postgres
@pytest.mark.django_db
def test_receivers_add_no_statement_to_a_run(received: list[Any]) -> None:
    sql = one_step_run_statements(_engine())
    assert len(sql) == len(ONE_STEP_RUN), sql
    names = [name for name, _ in received]
    # The start's own _run_created waits for the test's transaction, which never commits.
    assert names == ["run_started", "step_finished", "run_finished"]


@pytest.mark.django_db
def test_receivers_add_no_statement_to_a_start(received: list[Any]) -> None:
    engine = _engine()
    engine.start("w", {"key": "tenant:a"})  # creates the lock row (its signal waits for a commit that never comes)
    sql = statements(lambda: engine.start("w", {"key": "tenant:a"}))  # runs what waits for the commit
    assert len(sql) == start_queries(), sql
    assert [name for name, _ in received] == ["_run_created"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_racing_deliveries_send_each_signal_once(received: list[Any]) -> None:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: ctx.step("one", lambda: 1))
    engine = Engine(dispatch=lambda engine, run: None, registry=registry)
    for _ in range(5):
        handle = engine.start("w")
        barrier = threading.Barrier(4)

        def deliver(run_id: str = handle.run_id, barrier: threading.Barrier = barrier) -> None:
            barrier.wait(10)
            engine.execute(run_id)

        for thread in [started(deliver) for _ in range(4)]:
            thread.outcome()
        assert handle.refresh().status == RunStatus.COMPLETED
        mine = [name for name, kwargs in received if kwargs.get("run_id") == handle.run_id]
        assert sorted(mine) == ["_run_created", "run_finished", "run_started", "step_finished"]


@pytest.mark.django_db
def test_the_celery_task_of_a_failed_run_succeeds_and_the_failure_is_logged(caplog: Any) -> None:
    handle = default_engine.start("test.fatal")  # its step raises FatalError
    with caplog.at_level(logging.WARNING, logger="durable"):
        result = durable_tasks.execute_run.apply(args=(handle.run_id,))
    assert result.state == "SUCCESS"  # the task did its job: the failure is recorded
    handle.refresh()
    assert handle.status == RunStatus.FAILED
    assert handle.error["type"] == "durable.exceptions.FatalError" and "no retry for this" in handle.error["traceback"]
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.name == "durable.runtime.execution" and handle.run_id in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0].__name__ == "FatalError"


@pytest.mark.django_db
def test_the_admin_and_the_api_show_a_failed_runs_traceback(admin_client: Any, admin_user: Any) -> None:
    from django.urls import reverse
    from django.utils.html import escape
    from rest_framework.test import APIClient

    from durable import models

    handle = default_engine.start("test.fatal")
    durable_tasks.execute_run.apply(args=(handle.run_id,))
    traceback = handle.refresh().error["traceback"]

    pk = models.WorkflowRun.objects.get(run_id=handle.run_id).pk
    page = admin_client.get(reverse("admin:durable_workflowrun_change", args=[pk]))
    assert page.status_code == 200
    content = page.content.decode()
    assert "Traceback (most recent call last):" in content and "no retry for this" in content
    # Set as text, one frame a line, not as a JSON string with its newlines escaped.
    assert f'<pre class="durable-traceback" style="margin:0.5em 0 0; white-space:pre-wrap">{escape(traceback)}</pre>' in content

    api = APIClient()
    api.force_authenticate(admin_user)
    detail = api.get(f"/durable/runs/{handle.run_id}/")
    assert detail.status_code == 200, detail.content
    assert detail.json()["error"]["traceback"] == traceback

    # Anyone else authenticated sees the error without the project's file paths and source lines.
    from django.contrib.auth import get_user_model

    api.force_authenticate(get_user_model().objects.create_user("tenant-user"))
    for url in (f"/durable/runs/{handle.run_id}/", "/durable/runs/"):
        response = api.get(url)
        assert response.status_code == 200, response.content
        body = response.json()
        error = body["error"] if "error" in body else next(r for r in body["results"] if r["run_id"] == handle.run_id)["error"]
        assert error["type"] == "durable.exceptions.FatalError" and "no retry for this" in error["message"]
        assert "traceback" not in error
