"""PUT quotas/<key>/limit/ (limits changed live), the 429's retry_after and POST runs/?dry_run=1."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models import F
from django.urls import reverse
from rest_framework.test import APIClient

from durable import models
from tests.api.helpers import counts, quota_url, runs_url, start_add

pytestmark = pytest.mark.django_db


def limit_url(key: str) -> str:
    return reverse("durable:quota-limit", args=[key])


@pytest.fixture
def staff(user: Any) -> APIClient:
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    client = APIClient()
    client.force_authenticate(user)
    return client


def put(client: APIClient, key: str, body: Any) -> Any:
    return client.put(limit_url(key), body, format="json")


def test_the_limit_url_has_its_trailing_slash_and_keys_may_hold_slashes() -> None:
    assert limit_url("tenant:acme/eu") == "/durable/quotas/tenant:acme/eu/limit/"


def test_an_override_applies_on_the_next_start_and_clearing_restores_the_codes_limit(staff: APIClient) -> None:
    assert start_add(staff, "acme").status_code == 201  # test.add: 3 per key
    response = put(staff, "acme", {"limit": 1, "reason": "incident 42"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["key"], body["limit"], body["code_limit"], body["limit_override"], body["active"]) == ("acme", 1, 3, 1, 1)
    change = body["change"]
    assert (change["old_limit"], change["new_limit"], change["old_override"], change["new_override"]) == (3, 1, None, 1)
    assert (change["reason"], change["changed_by"]) == ("incident 42", "alice")
    refused = start_add(staff, "acme")
    assert refused.status_code == 429 and refused.json()["limit"] == 1
    assert staff.get(quota_url("acme")).json()["limit"] == 1
    cleared = put(staff, "acme", {"limit": None, "reason": "over"})
    assert cleared.status_code == 200 and cleared.json()["limit"] == 3 and cleared.json()["limit_override"] is None
    assert start_add(staff, "acme").status_code == 201
    assert list(models.LimitChange.objects.values_list("new_override", "reason")) == [(None, "over"), (1, "incident 42")]


def test_a_key_no_start_used_yet_can_be_limited(staff: APIClient) -> None:
    response = put(staff, "fresh", {"limit": 0, "reason": "blocked"})
    assert response.status_code == 200
    assert (response.json()["limit"], response.json()["code_limit"], response.json()["active"]) == (0, None, 0)
    assert start_add(staff, "fresh").status_code == 429


def test_only_staff_may_change_a_limit(api: APIClient, anon: APIClient) -> None:
    assert put(api, "acme", {"limit": 1, "reason": "r"}).status_code == 403
    assert put(anon, "acme", {"limit": 1, "reason": "r"}).status_code in (401, 403)
    assert not models.LimitChange.objects.exists() and not models.ConcurrencyLock.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"limit": 1},
        {"reason": "r"},
        {"limit": 1, "reason": ""},
        {"limit": 1, "reason": "   "},
        {"limit": "1", "reason": "r"},
        {"limit": 1.0, "reason": "r"},
        {"limit": True, "reason": "r"},
        {"limit": 2**31, "reason": "r"},
        {"limit": 1, "reason": 5},
        {"limit": 1, "reason": "r", "extra": 1},
        [1],
    ],
)
def test_a_bad_body_is_400_and_changes_nothing(staff: APIClient, body: Any) -> None:
    response = put(staff, "acme", body)
    assert response.status_code == 400, (body, response.content)
    assert not models.LimitChange.objects.exists() and not models.ConcurrencyLock.objects.exists()


def test_other_methods_of_the_limit_url_are_405(staff: APIClient) -> None:
    assert staff.get(limit_url("acme")).status_code == 405
    assert staff.post(limit_url("acme"), {}, format="json").status_code == 405


# -- Retry-After -----------------------------------------------------------------------------


def test_the_429_body_carries_the_same_retry_after_as_its_header(api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "RETRY_AFTER": 7}
    for _ in range(3):
        start_add(api, "acme")
    response = start_add(api, "acme")
    assert response.status_code == 429
    assert response["Retry-After"] == "7" and response.json()["retry_after"] == 7


def test_the_429_estimates_from_the_keys_recent_durations(api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "RETRY_AFTER": 1, "RETRY_AFTER_MAX": 300}
    for _ in range(3):
        start_add(api, "acme")
    models.ConcurrencyLock.objects.filter(key="acme").update(recent_durations=[30.0, 90.0, 60.0, 20.0, 100.0])
    models.RunTag.objects.update(created_at=F("created_at") - timedelta(seconds=20))
    response = start_add(api, "acme")
    # The median 60 s minus the 20 s the oldest run in flight has held its slot.
    assert response.status_code == 429
    assert 40 <= int(response["Retry-After"]) <= 41 and response.json()["retry_after"] == int(response["Retry-After"])


# -- dry run -------------------------------------------------------------------------------------


def dry_run(client: APIClient, key: str, flag: str = "1", **fields: Any) -> Any:
    body = {"workflow": "test.add", "input": {"a": 1, "b": 2, "key": key}, **fields}
    return client.post(f"{runs_url()}?dry_run={flag}", body, format="json")


def test_a_dry_run_answers_whether_a_start_would_be_admitted_and_creates_nothing(api: APIClient) -> None:
    before = counts()
    response = dry_run(api, "acme")
    assert response.status_code == 200
    body = response.json()
    assert (body["admitted"], body["outcome"], body["key"], body["limit"], body["active"]) == (True, "admit", "acme", 3, 0)
    assert body["keys"][0]["strategy"] == "reject"
    assert counts() == before and not models.ConcurrencyLock.objects.exists()
    for _ in range(3):
        start_add(api, "acme")
    refused = dry_run(api, "acme", "true").json()
    assert (refused["admitted"], refused["outcome"], refused["active"], refused["retry_after"]) == (False, "reject", 3, 1)
    assert models.WorkflowRun.objects.count() == 3


def test_a_dry_run_of_a_queued_key_says_queue(api: APIClient) -> None:
    body = {"workflow": "api.queued", "input": {"key": "q"}}
    api.post(runs_url(), body, format="json")
    answer = api.post(f"{runs_url()}?dry_run=1", body, format="json").json()
    assert (answer["admitted"], answer["outcome"], answer["keys"][0]["queued"]) == (False, "queue", 0)


def test_a_dry_run_is_validated_as_a_start(api: APIClient) -> None:
    before = counts()
    assert api.post(f"{runs_url()}?dry_run=1", {"workflow": "no.such", "input": {}}, format="json").status_code == 404
    assert api.post(f"{runs_url()}?dry_run=1", {"input": {}}, format="json").status_code == 400
    assert dry_run(api, "acme", run_id="a/b").status_code == 400
    assert dry_run(api, "acme", flag="maybe").status_code == 400
    assert counts() == before


def test_dry_run_zero_starts_for_real(api: APIClient) -> None:
    assert dry_run(api, "acme", flag="0").status_code == 201


def test_a_dry_run_of_an_existing_run_id_says_exists(api: APIClient) -> None:
    start_add(api, "acme", run_id="r1")
    answer = dry_run(api, "acme", run_id="r1").json()
    assert (answer["admitted"], answer["outcome"]) == (False, "exists")
