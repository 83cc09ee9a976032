"""POST runs/<run_id>/signal/."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from durable import RunStatus, engine
from durable.models import Signal
from durable.testing import WorkflowRunFactory, wait_for
from tests.api.helpers import signal_url

pytestmark = pytest.mark.django_db


def test_signal_is_buffered_for_a_run_not_yet_waiting(api: APIClient) -> None:
    WorkflowRunFactory(run_id="r1", status=RunStatus.RUNNING)
    response = api.post(signal_url("r1"), {"name": "approve", "payload": {"by": "ana"}}, format="json")
    assert response.status_code == 202
    assert response.json()["run_id"] == "r1"
    [signal] = Signal.objects.all()
    assert (signal.name, signal.payload, signal.consumed_at_position) == ("approve", {"by": "ana"}, None)


def test_signal_wakes_a_run_waiting_for_it(api: APIClient) -> None:
    WorkflowRunFactory(run_id="r1", status=RunStatus.SUSPENDED, waiting_for="signal:approve")
    assert api.post(signal_url("r1"), {"name": "approve"}, format="json").status_code == 202
    assert engine.get_run("r1").status == RunStatus.PENDING


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled", "dead"])
def test_signal_to_a_finished_run_is_409(api: APIClient, status: str) -> None:
    WorkflowRunFactory(run_id="r1", status=status)
    response = api.post(signal_url("r1"), {"name": "approve"}, format="json")
    assert response.status_code == 409
    assert response.json()["code"] == "run_terminal"
    assert not Signal.objects.exists()


def test_signal_to_an_unknown_run_is_404(api: APIClient) -> None:
    assert api.post(signal_url("nope"), {"name": "approve"}, format="json").status_code == 404


@pytest.mark.parametrize(
    "body",
    [{}, {"name": ""}, {"name": 5}, {"name": "x" * 256}, {"name": "ok", "extra": 1}, [1], "text"],
    ids=["missing", "empty", "number", "too-long", "unknown-field", "list", "string"],
)
def test_malformed_signal_bodies_are_400(api: APIClient, body: Any) -> None:
    WorkflowRunFactory(run_id="r1", status=RunStatus.RUNNING)
    response = api.post(signal_url("r1"), body, format="json")
    assert response.status_code == 400
    assert not Signal.objects.exists()


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_signal_over_http_completes_a_waiting_run_on_the_worker(api: APIClient, celery_worker: Any) -> None:
    parent = engine.start("test.approval_parent", {"n": 1})
    wait_for(lambda: parent.refresh().record.waiting_for == "signal:decision", timeout=20, what="the signal wait")
    response = api.post(signal_url(parent.run_id), {"name": "decision", "payload": "yes"}, format="json")
    assert response.status_code == 202
    assert parent.result(timeout=20)["decision"] == "yes"
