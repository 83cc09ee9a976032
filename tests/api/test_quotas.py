"""GET quotas/ and GET quotas/<key>/."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from durable import Concurrency, DurableWorkflow, WorkflowContext
from durable.models import ConcurrencyLock
from durable.stores import DjangoStore
from durable.testing import WorkflowRunFactory, tagged
from tests.api.helpers import quota_url, start_add

pytestmark = pytest.mark.django_db

#: The per-plan limit of each key of ``api.plan`` (a test changes a plan).
PLAN_LIMITS: dict[str, int] = {}


class PlanWorkflow(DurableWorkflow):
    """Limit per ``input["key"]``, looked up in its plan at each start."""

    name = "api.plan"
    version = "1"
    concurrency = Concurrency(key=lambda input: input["key"], limit=lambda key: PLAN_LIMITS[key])

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        return input


def test_quota_urls() -> None:
    assert quota_url() == "/durable/quotas/"
    assert quota_url("tenant:acme/eu") == "/durable/quotas/tenant:acme/eu/"


def test_quotas_after_starts_over_http(api: APIClient) -> None:
    for _ in range(2):
        assert start_add(api, "tenant:acme").status_code == 201
    start_add(api, "tenant:globex")
    response = api.get(quota_url())
    assert response.status_code == 200
    body = response.json()
    assert len(body["results"]) == 2
    acme, globex = body["results"]
    assert acme["key"] == "tenant:acme"
    assert (acme["active"], acme["queued"], acme["limit"]) == (2, 0, 3)
    assert acme["count_statuses"] == ["pending", "running", "suspended", "blocked"]
    assert acme["oldest_active_at"] is not None
    assert (globex["key"], globex["active"]) == ("tenant:globex", 1)


def test_quota_detail_counts_only_the_counted_statuses(api: APIClient) -> None:
    ConcurrencyLock.objects.create(key="tenant:acme/eu", limit=5, count_statuses=["running"])
    tagged(WorkflowRunFactory(status="running"), "concurrency:tenant:acme/eu")
    tagged(WorkflowRunFactory(status="pending"), "concurrency:tenant:acme/eu")
    tagged(WorkflowRunFactory(status="queued"), "concurrency:tenant:acme/eu")
    tagged(WorkflowRunFactory(status="completed"), "concurrency:tenant:acme/eu")
    response = api.get(quota_url("tenant:acme/eu"))
    assert response.status_code == 200
    assert response.json() == {
        "key": "tenant:acme/eu",
        "active": 1,
        "queued": 1,
        "limit": 5,
        "code_limit": 5,
        "limit_override": None,
        "count_statuses": ["running"],
        "oldest_active_at": response.json()["oldest_active_at"],
        "oldest_queued_at": response.json()["oldest_queued_at"],
        "oldest_queued_age": response.json()["oldest_queued_age"],
    }
    assert response.json()["oldest_active_at"] is not None
    assert response.json()["oldest_queued_at"] is not None


def test_lifetime_cap_counts_its_finished_runs_as_admission_does(api: APIClient) -> None:
    ConcurrencyLock.objects.create(key="onboarding:acme", limit=3, count_statuses=["pending", "completed"])
    ConcurrencyLock.objects.create(key="tenant:acme", limit=3, count_statuses=["pending"])
    tagged(WorkflowRunFactory(status="completed"), "concurrency:onboarding:acme")
    tagged(WorkflowRunFactory(status="completed"), "concurrency:onboarding:acme")
    tagged(WorkflowRunFactory(status="pending"), "concurrency:onboarding:acme")
    tagged(WorkflowRunFactory(status="failed"), "concurrency:onboarding:acme")  # not counted
    tagged(WorkflowRunFactory(status="completed"), "concurrency:tenant:acme")  # this key counts pending only
    body = {q["key"]: q for q in api.get(quota_url()).json()["results"]}
    admission = DjangoStore().count_runs(tag="concurrency:onboarding:acme", statuses=["pending", "completed"])
    assert body["onboarding:acme"]["active"] == admission == 3  # full, as the next start will find it
    assert body["tenant:acme"]["active"] == 0


def test_quota_with_unknown_limit_and_no_active_runs(api: APIClient) -> None:
    ConcurrencyLock.objects.create(key="idle", limit=None, count_statuses=[])
    tagged(WorkflowRunFactory(status="completed"), "concurrency:idle")
    body = api.get(quota_url("idle")).json()
    assert (body["limit"], body["active"], body["queued"], body["oldest_active_at"]) == (None, 0, 0, None)
    assert body["count_statuses"] == ["pending", "running", "suspended", "blocked"]


@pytest.mark.parametrize("key", ["nope", "tenant:acme/x", "a%00b", "k" * 300])
def test_unknown_quota_key_is_404(api: APIClient, key: str) -> None:
    ConcurrencyLock.objects.create(key="tenant:acme", limit=1)
    response = api.get(f"/durable/quotas/{key}/")
    assert response.status_code == 404
    assert response.json()["code"] == "quota_not_found"


def test_quota_list_is_paginated(api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_PAGE_SIZE": 2}
    for key in ("a", "b", "c"):
        ConcurrencyLock.objects.create(key=key, limit=1)
    first = api.get(quota_url())
    assert set(first.json()) == {"next", "previous", "results"}  # a cursor page: no count
    assert [q["key"] for q in first.json()["results"]] == ["a", "b"]
    second = api.get(first.json()["next"]).json()
    assert [q["key"] for q in second["results"]] == ["c"]
    assert second["next"] is None
    assert [q["key"] for q in api.get(second["previous"]).json()["results"]] == ["a", "b"]


def test_no_quotas_is_an_empty_list(api: APIClient) -> None:
    assert api.get(quota_url()).json() == {"next": None, "previous": None, "results": []}


def test_quota_shows_the_age_of_the_oldest_queued_run(api: APIClient) -> None:
    from datetime import timedelta

    from django.utils import timezone

    ConcurrencyLock.objects.create(key="busy", limit=1, count_statuses=["pending", "running"])
    tagged(WorkflowRunFactory(status="running"), "concurrency:busy")
    waited = WorkflowRunFactory(status="queued")
    type(waited).objects.filter(pk=waited.pk).update(created_at=timezone.now() - timedelta(seconds=90))
    tagged(waited, "concurrency:busy")
    tagged(WorkflowRunFactory(status="queued"), "concurrency:busy")
    body = api.get(quota_url("busy")).json()
    assert (body["active"], body["queued"]) == (1, 2)
    assert 89 <= body["oldest_queued_age"] < 300
    assert api.get(quota_url()).json()["results"][0]["oldest_queued_age"] >= 89


@pytest.mark.parametrize("new_limit", [2, 3])
def test_a_refused_start_shows_the_limit_it_was_refused_with(api: APIClient, admin_client: Any, new_limit: int) -> None:
    # The plan allows 5, three runs are in flight, then the plan drops to 2 (or 3):
    # the next start is refused with the new limit, and the API and the admin say
    # "3 of <new limit>" (not "3 of 5", which would promise two more starts).
    PLAN_LIMITS["plan:acme"] = 5
    start = {"workflow": "api.plan", "input": {"key": "plan:acme"}}
    for _ in range(3):
        assert api.post("/durable/runs/", start, format="json").status_code == 201
    PLAN_LIMITS["plan:acme"] = new_limit
    refused = api.post("/durable/runs/", start, format="json")
    assert refused.status_code == 429
    assert (refused.json()["limit"], refused.json()["active"]) == (new_limit, 3)
    body = api.get(quota_url("plan:acme")).json()
    assert (body["active"], body["limit"]) == (3, new_limit)
    assert [q["limit"] for q in api.get(quota_url()).json()["results"]] == [new_limit]
    from django.contrib.admin.utils import quote
    from django.urls import reverse

    page = admin_client.get(reverse("admin:durable_concurrencylock_changelist")).content.decode()
    row = page[page.index(">plan:acme</a>") :]
    assert f'<span class="durable-use-count">3 / {new_limit}</span>' in row[: row.index("</tr>")]
    detail = admin_client.get(reverse("admin:durable_concurrencylock_change", args=[quote("plan:acme")])).content.decode()
    assert f'<div class="readonly">{new_limit} (from the code)' in detail
    assert '<div class="readonly">5 (from the code)' not in detail


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_recording_a_refused_starts_limit_never_waits_for_the_keys_lock() -> None:
    # A starter holds the key's row lock; a start refused meanwhile with a new limit
    # must return at once (the row it would record on is skipped, not waited for),
    # and the next refusal after the lock is released records the limit.
    from durable import ConcurrencyLimitError, Engine
    from durable.runtime import Registry
    from durable.testing import wait_for
    from tests.threads import held_open, started

    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None)
    engine = Engine(dispatch=lambda engine, run: None, registry=registry)
    for _ in range(2):
        engine.start("w", {}, concurrency=Concurrency(key="held", limit=2))

    def refused_start() -> int:
        with pytest.raises(ConcurrencyLimitError) as refused:
            engine.start("w", {}, concurrency=Concurrency(key="held", limit=1))
        return refused.value.limit

    with held_open(lambda: ConcurrencyLock.objects.select_for_update().get(key="held")):
        starter = started(refused_start)
        wait_for(lambda: not starter.is_alive(), timeout=30, what="the refused start to return while the key is locked")
        assert starter.outcome() == 1
        assert ConcurrencyLock.objects.get(key="held").limit == 2  # skipped while locked
    with pytest.raises(ConcurrencyLimitError):
        engine.start("w", {}, concurrency=Concurrency(key="held", limit=1))
    assert ConcurrencyLock.objects.get(key="held").limit == 1


@pytest.mark.parametrize("keys", [3, 40])
def test_quota_list_counts_only_the_page_keys(api: APIClient, settings: Any, django_assert_num_queries: Any, keys: int) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    settings.DURABLE = {**settings.DURABLE, "API_PAGE_SIZE": 2}
    for i in range(keys):
        ConcurrencyLock.objects.create(key=f"k{i:03}", limit=5)
        tagged(WorkflowRunFactory(status="running"), f"concurrency:k{i:03}")
    # The page of lock rows, then one grouped count of those keys' runs.
    with django_assert_num_queries(2), CaptureQueriesContext(connection) as captured:
        response = api.get(quota_url())
    assert [(q["key"], q["active"]) for q in response.json()["results"]] == [("k000", 1), ("k001", 1)]
    sql = "\n".join(q["sql"] for q in captured.captured_queries)
    assert "concurrency:k001" in sql
    assert "concurrency:k002" not in sql  # the keys after the page are never counted
