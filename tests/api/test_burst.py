"""A key with a burst over HTTP: the 429 says what refused; GET quotas/ shows guaranteed, borrowed and pool."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from durable import Burst, Concurrency, DurableWorkflow, WorkflowContext
from tests.api.helpers import counts, quota_url, runs_url, start_add

pytestmark = pytest.mark.django_db


class BurstWorkflow(DurableWorkflow):
    """One guaranteed run per ``input["key"]``, up to 3 with the pool's."""

    name = "api.burst"
    version = "1"
    concurrency = Concurrency(key=lambda input: input["key"], limit=1, burst=Burst(pool="api-pool", up_to=3))

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        return input


@pytest.fixture(autouse=True)
def pool(settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {"api-pool": 2}, "RETRY_AFTER": 5}


def start(api: APIClient, key: str) -> Any:
    return api.post(runs_url(), {"workflow": "api.burst", "input": {"key": key}}, format="json")


def test_a_refusal_by_the_pool_says_so(api: APIClient) -> None:
    assert [start(api, "acme").status_code for _ in range(3)] == [201, 201, 201]  # 1 guaranteed, 2 borrowed
    assert start(api, "globex").status_code == 201  # globex's guarantee, the pool being full
    before = counts()
    response = start(api, "globex")
    assert response.status_code == 429
    assert response["Retry-After"] == "5"
    body = response.json()
    assert (body["code"], body["key"], body["limit"], body["active"]) == ("concurrency_limit", "globex", 1, 1)
    assert (body["source"], body["pool"], body["pool_limit"], body["pool_active"]) == ("pool", "api-pool", 2, 2)
    assert (body["up_to"], body["borrowed"]) == (3, 0)
    assert "pool 'api-pool' is full" in body["detail"]
    assert counts() == before


def test_a_refusal_at_the_ceiling_says_so(api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {"api-pool": 10}}
    for _ in range(3):
        assert start(api, "acme").status_code == 201
    body = start(api, "acme").json()
    assert (body["source"], body["active"], body["up_to"], body["borrowed"], body["pool_active"]) == ("up_to", 3, 3, 2, 2)


def test_a_key_without_burst_keeps_its_bodies(api: APIClient) -> None:
    for _ in range(3):
        start_add(api, "plain")
    body = start_add(api, "plain").json()
    assert body["key"] == "plain"
    assert "source" not in body and "pool" not in body
    assert "borrowed" not in api.get(quota_url("plain")).json()


def test_quotas_show_guaranteed_borrowed_and_the_pool(api: APIClient) -> None:
    for _ in range(2):
        start(api, "acme")  # 1 guaranteed, 1 borrowed
    start(api, "globex")
    results = {q["key"]: q for q in api.get(quota_url()).json()["results"]}
    acme, globex, pool = results["acme"], results["globex"], results["api-pool"]
    assert (acme["active"], acme["guaranteed"], acme["borrowed"], acme["limit"], acme["up_to"]) == (2, 1, 1, 1, 3)
    assert (acme["pool"], acme["pool_limit"], acme["pool_active"], acme["is_pool"]) == ("api-pool", 2, 1, False)
    assert (globex["guaranteed"], globex["borrowed"], globex["pool_active"]) == (1, 0, 1)
    assert (pool["is_pool"], pool["active"], pool["limit"], pool["pool"], pool["borrowed"]) == (True, 1, 2, None, 0)
    detail = api.get(quota_url("acme")).json()
    assert (detail["guaranteed"], detail["borrowed"], detail["pool_active"]) == (1, 1, 1)
