"""``Idempotency-Key`` on ``POST runs/``: a retried start returns the first one's run."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from durable.api import idempotency
from durable.models import WorkflowRun
from tests.api.helpers import runs_url
from tests.threads import started

pytestmark = pytest.mark.django_db

TENANTS = "tests.api.tenants.by_username"


def start(client: APIClient, key: str | None, input: Any = None, workflow: str = "api.one", **body: Any) -> Any:
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    data = {"workflow": workflow, "input": {"key": "k"} if input is None else input, **body}
    return client.post(runs_url(), data, format="json", **headers)


def test_a_retried_start_returns_the_same_run_with_200_even_when_its_key_is_full(api: APIClient) -> None:
    first = start(api, "order-1")
    assert first.status_code == 201
    retried = start(api, "order-1")  # limit 1, the first run holds it: no 429 for a retry
    assert retried.status_code == 200
    assert retried.json()["run_id"] == first.json()["run_id"]
    assert first.json()["run_id"].startswith(idempotency.RUN_ID_PREFIX)
    assert WorkflowRun.objects.count() == 1
    # Another key is another start: refused by the full quota.
    assert start(api, "order-2").status_code == 429


@pytest.mark.parametrize("changed", [{"input": {"key": "k", "more": 1}}, {"workflow": "test.add"}])
def test_the_key_used_again_for_another_request_is_a_422(api: APIClient, changed: dict[str, Any]) -> None:
    assert start(api, "order-1").status_code == 201
    response = start(api, "order-1", **changed)
    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert WorkflowRun.objects.count() == 1


@pytest.mark.parametrize("key", ["", "x" * 256, "line\nbreak", "tab\there"])
def test_a_bad_key_is_a_400_and_creates_nothing(api: APIClient, key: str) -> None:
    response = start(api, key)
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_idempotency_key"
    assert WorkflowRun.objects.count() == 0


def test_a_key_and_a_run_id_together_are_a_400(api: APIClient) -> None:
    response = start(api, "order-1", run_id="mine")
    assert response.status_code == 400 and "run_id" in response.json()
    assert WorkflowRun.objects.count() == 0


def test_a_body_may_not_choose_a_run_id_of_the_keys(api: APIClient) -> None:
    # Else a tenant could take another tenant's key's run id (the digest is no secret).
    response = start(api, None, run_id=idempotency.run_id("tenant-bob", "order-1"))
    assert response.status_code == 400 and "run_id" in response.json()


def test_two_tenants_with_the_same_key_get_two_runs(settings: Any, django_user_model: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_NAMESPACE": TENANTS}
    responses = []
    for name in ("alice", "bob"):
        client = APIClient()
        client.force_authenticate(django_user_model.objects.create_user(username=name))
        responses.append(start(client, "order-1", input={"key": name}))
    assert [r.status_code for r in responses] == [201, 201]
    assert responses[0].json()["run_id"] != responses[1].json()["run_id"]
    assert [r.json()["namespace"] for r in responses] == ["tenant-alice", "tenant-bob"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round", range(5))
def test_two_concurrent_requests_with_one_key_make_one_run(round: int) -> None:
    # Real threads on connections of their own, limit 1: one creates (201), the
    # other returns that run (200) — never a 429, never a second run.
    user = get_user_model().objects.create_user(username=f"racer{round}")

    def request() -> tuple[int, str]:
        client = APIClient()
        client.force_authenticate(user)
        response = start(client, f"race-{round}", input={"key": f"race-{round}"})
        return response.status_code, response.json().get("run_id", response.json())

    threads = [started(request) for _ in range(2)]
    outcomes = sorted(thread.outcome() for thread in threads)
    assert [code for code, _ in outcomes] == [200, 201]
    assert outcomes[0][1] == outcomes[1][1]
    assert WorkflowRun.objects.filter(run_id=outcomes[0][1]).count() == 1
    assert WorkflowRun.objects.count() == 1
