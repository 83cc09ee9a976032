"""``durable.api.exception_handler`` for a project's own DRF views."""

from __future__ import annotations

from typing import Any

import pytest
from django.http import Http404
from django.urls import path
from rest_framework import exceptions as drf_exceptions
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

from durable import ConcurrencyLimitError, ConcurrencyQueueFullError, exceptions, models
from durable.api import exception_handler
from tests.workflows import AddWorkflow


class StartAddView(APIView):
    """A project view that starts a workflow with ``dispatch`` and lets errors propagate."""

    permission_classes = [AllowAny]

    def post(self, request: Request) -> Response:
        handle = AddWorkflow.dispatch(request.data)
        return Response({"run_id": handle.run_id}, status=201)


class RaiseView(APIView):
    permission_classes = [AllowAny]
    errors: dict[str, Exception] = {
        "queue-full": ConcurrencyQueueFullError(workflow="w", key="k", limit=2, active=2, queued=5, max_queued=5),
        "http404": Http404("no such page"),
        "throttled": drf_exceptions.Throttled(wait=12),
    }

    def get(self, request: Request, name: str) -> Response:
        raise self.errors[name]


urlpatterns = [
    path("start/", StartAddView.as_view()),
    path("raise/<str:name>/", RaiseView.as_view()),
]


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_project_view_turns_a_full_quota_into_429(settings: Any) -> None:
    assert settings.REST_FRAMEWORK["EXCEPTION_HANDLER"] == "durable.api.exception_handler"
    settings.DURABLE = {**settings.DURABLE, "RETRY_AFTER": 4}
    client = APIClient()
    for _ in range(3):
        assert client.post("/start/", {"a": 1, "b": 2, "key": "acme"}, format="json").status_code == 201
    before = models.WorkflowRun.objects.count()
    response = client.post("/start/", {"a": 1, "b": 2, "key": "acme"}, format="json")
    assert response.status_code == 429
    assert response["Retry-After"] == "4"
    body = response.json()
    assert set(body) == {"detail", "code", "workflow", "key", "limit", "active", "retry_after"}
    assert body["retry_after"] == 4
    assert (body["code"], body["workflow"], body["key"], body["limit"], body["active"]) == (
        "concurrency_limit",
        "test.add",
        "acme",
        3,
        3,
    )
    assert models.WorkflowRun.objects.count() == before


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_project_view_turns_invalid_input_into_400() -> None:
    response = APIClient().post("/start/", [1, 2], format="json")  # the key function needs a dict
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_start"
    assert models.WorkflowRun.objects.count() == 0


@pytest.mark.urls(__name__)
def test_queue_full_is_429_with_its_own_code() -> None:
    response = APIClient().get("/raise/queue-full/")
    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    assert response.json()["code"] == "concurrency_queue_full"
    body = response.json()
    assert (body["key"], body["limit"], body["active"], body["queued"], body["max_queued"]) == ("k", 2, 2, 5, 5)


@pytest.mark.urls(__name__)
def test_other_errors_keep_drf_behaviour() -> None:
    client = APIClient()
    missing = client.get("/raise/http404/")
    assert missing.status_code == 404
    assert missing.json() == {"detail": "no such page"}
    throttled = client.get("/raise/throttled/")
    assert throttled.status_code == 429
    assert throttled["Retry-After"] == "12"


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (ConcurrencyLimitError(workflow="w", key="k", limit=1, active=1), 429, "concurrency_limit"),
        (
            ConcurrencyQueueFullError(workflow="w", key="k", limit=1, active=1, queued=0, max_queued=0),
            429,
            "concurrency_queue_full",
        ),
        (exceptions.InvalidStartError("bad input"), 400, "invalid_start"),
        (exceptions.UnknownWorkflowError("no such workflow"), 404, "unknown_workflow"),
        (exceptions.RunNotFound("no such run"), 404, "run_not_found"),
        (exceptions.RunTerminalError("finished"), 409, "run_terminal"),
    ],
)
def test_handler_maps_durable_errors(exc: Exception, status: int, code: str) -> None:
    response = exception_handler(exc, {})
    assert response is not None
    assert response.status_code == status
    assert response.data["code"] == code
    assert response.data["detail"] == str(exc)
    assert ("Retry-After" in response.headers) == (status == 429)


@pytest.mark.parametrize(
    "exc",
    [ValueError("x"), exceptions.RunFailedError("failed"), exceptions.DurableError(), exceptions.NonDeterminismError()],
)
def test_handler_leaves_other_errors_unhandled(exc: Exception) -> None:
    assert exception_handler(exc, {}) is None


def test_handler_is_importable_from_the_contract_path() -> None:
    from django.utils.module_loading import import_string

    assert import_string("durable.api.exception_handler") is exception_handler
