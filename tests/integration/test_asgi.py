"""The async API under ASGI, through Django's ``AsyncClient``.

Django's ``ASGIHandler`` serves each request in a ``ThreadSensitiveContext`` of its
own, so the sync code a request runs (``sync_to_async``: here durable's admission)
gets a thread, and a database connection, of its own. The test client does not,
so each request here is wrapped the same way: the 50 starts below are 50 requests
admitted in parallel on their own connections, as under a real ASGI server.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.contrib.auth import get_user_model
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.test import AsyncClient, override_settings
from django.urls import path

import durable
from durable import Concurrency, ConcurrencyLimitError, DjangoStore, DurableWorkflow, Engine, WorkflowContext, models
from durable.api.errors import durable_error_response
from durable.http import error_response
from durable.runtime import Dispatcher
from durable.stores import RunRecord
from testproject.chat.workflows import ChatTurnWorkflow

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 5
STARTS = 50


class _Admissions:
    """What the key function (run in each request's sync thread) saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.backends: set[int] = set()
        self.loop_tasks: list[bool] = []


SEEN = _Admissions()


def _key(input: dict[str, Any]) -> str:
    with SEEN.lock:
        SEEN.inside += 1
        SEEN.most_inside = max(SEEN.most_inside, SEEN.inside)
    if connection.vendor == "postgresql":
        connection.ensure_connection()
        with SEEN.lock:
            SEEN.backends.add(connection.connection.info.backend_pid)
    time.sleep(0.02)  # a window for the other requests' threads to be in here too
    with SEEN.lock:
        SEEN.inside -= 1
    return input["key"]


async def _limit(key: str) -> int:
    # Awaited by the request's own task: on the event loop, no thread hop.
    SEEN.loop_tasks.append(asyncio.current_task() is not None)
    return LIMIT


class AsgiLimited(DurableWorkflow):
    name = "test.asgi_limited"
    concurrency = Concurrency(key=_key, limit=_limit)

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        # Holds its slot (suspended counts) when the session's in-process worker
        # executes it: a run that finished would free its slot during the test.
        return ctx.wait_for_signal("never")


async def _start(request: HttpRequest) -> JsonResponse:
    try:
        handle = await AsgiLimited.adispatch(json.loads(request.body))
    except durable.DurableError as exc:
        response = error_response(exc)
        assert response is not None
        return response
    return JsonResponse({"run_id": handle.run_id}, status=202)


urlpatterns = [path("start/", _start)]


class _NoDispatch(Dispatcher):
    def send(self, engine: Engine, run: RunRecord) -> None:
        pass

    def revoke(self, engine: Engine, run: RunRecord) -> None:
        pass


def _close_connection() -> None:
    connection.close()  # this thread's connection (read in the thread, not bound in the caller's)


async def _post(url: str, body: dict[str, Any], *, user: Any = None) -> Any:
    async with ThreadSensitiveContext():  # as Django's ASGIHandler serves each request
        client = AsyncClient()
        if user is not None:
            await client.aforce_login(user)
        response = await client.post(url, body, content_type="application/json")
        # The request's thread closes its connection, as request_finished does
        # under ASGIHandler (the test client leaves it open).
        await sync_to_async(_close_connection)()
        return response


@pytest.mark.postgres
@override_settings(ROOT_URLCONF=__name__)
def test_fifty_concurrent_async_starts_on_one_key_admit_exactly_the_limit() -> None:
    global SEEN
    SEEN = _Admissions()

    async def starts() -> list[Any]:
        return await asyncio.gather(*(_post("/start/", {"key": "tenant:acme"}) for _ in range(STARTS)))

    responses = asyncio.run(starts())

    codes = sorted(r.status_code for r in responses)
    assert codes == [202] * LIMIT + [429] * (STARTS - LIMIT)
    for refused in (r for r in responses if r.status_code == 429):
        body = refused.json()
        assert (body["code"], body["key"], body["limit"], body["active"]) == ("concurrency_limit", "tenant:acme", LIMIT, LIMIT)
        assert refused["Retry-After"] == str(body["retry_after"])
    admitted = {r.json()["run_id"] for r in responses if r.status_code == 202}
    runs = models.WorkflowRun.objects.filter(workflow="test.asgi_limited")
    assert set(runs.values_list("run_id", flat=True)) == admitted
    assert models.RunTag.objects.filter(tag="concurrency:tenant:acme").count() == LIMIT
    # Real parallelism: requests were admitted at the same time, on connections of their own.
    assert SEEN.most_inside >= 2, SEEN.most_inside
    assert len(SEEN.backends) >= 2, SEEN.backends
    assert SEEN.loop_tasks == [True] * STARTS


def test_the_async_chat_view_answers_202_then_429_with_the_drf_handlers_body(monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs stay pending (no worker gets them, not even the session's in-process one):
    # the tenant's 8 slots stay taken while the test runs.
    monkeypatch.setattr(
        ChatTurnWorkflow, "engine", Engine(DjangoStore(), dispatch=_NoDispatch(), registry=durable.engine.registry)
    )
    user = get_user_model().objects.create_user("ada", password="pw")
    tenant = str(user.pk)

    def anonymous(body: dict[str, Any]) -> Any:
        return asyncio.run(_post("/chat/turns/", body))

    def signed_in(body: dict[str, Any]) -> Any:
        return asyncio.run(_post("/chat/turns/", body, user=user))

    assert anonymous({"message": "hi"}).status_code == 401
    assert signed_in({"text": "no message"}).status_code == 400
    accepted = signed_in({"message": "hi"})
    assert accepted.status_code == 202
    assert models.WorkflowRun.objects.get(run_id=accepted.json()["run_id"]).input["tenant_id"] == tenant
    for _ in range(7):  # the tenant's 8 slots taken
        ChatTurnWorkflow.dispatch({"tenant_id": tenant, "message": "hi"})

    busy = signed_in({"message": "one more"})

    assert busy.status_code == 429
    with pytest.raises(ConcurrencyLimitError) as refused:
        ChatTurnWorkflow.dispatch({"tenant_id": tenant, "message": "hi"})
    drf = durable_error_response(refused.value)
    assert drf is not None
    body, expected = busy.json(), dict(drf.data)
    # The estimate moves with the age of the oldest run in flight: the same source, read a moment apart.
    assert abs(body.pop("retry_after") - expected.pop("retry_after")) <= 1
    assert body == expected and body["key"] == f"tenant:{tenant}" and body["limit"] == 8
    assert int(busy["Retry-After"]) >= 1
    assert models.WorkflowRun.objects.filter(workflow="chat.turn").count() == 8
