"""Authentication, permission classes and tenant fencing (API_NAMESPACE)."""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from rest_framework.test import APIClient

from durable import models
from durable.testing import WorkflowRunFactory
from tests.api.helpers import add_input, cancel_url, counts, quota_url, run_url, runs_url, signal_url, start_add

pytestmark = pytest.mark.django_db

TENANTS = "tests.api.tenants.by_username"


def every_endpoint() -> list[tuple[str, str]]:
    return [
        ("get", runs_url()),
        ("post", runs_url()),
        ("get", run_url("r1")),
        ("post", cancel_url("r1")),
        ("post", signal_url("r1")),
        ("get", quota_url()),
        ("get", quota_url("k")),
    ]


@pytest.mark.parametrize(("method", "url"), every_endpoint())
def test_unauthenticated_requests_are_refused(anon: APIClient, method: str, url: str) -> None:
    WorkflowRunFactory(run_id="r1")
    models.ConcurrencyLock.objects.create(key="k", limit=1)
    before = counts()
    response = getattr(anon, method)(url, {"workflow": "test.add", "input": add_input()}, format="json")
    assert response.status_code in (401, 403)
    assert response.json()["code"] == "not_authenticated"
    assert counts() == before
    assert models.WorkflowRun.objects.get(run_id="r1").status == "pending"


def test_session_and_basic_authentication_work(user: Any) -> None:
    session = APIClient()
    assert session.login(username="alice", password="pw")
    assert session.get(runs_url()).status_code == 200
    basic = APIClient()
    basic.credentials(HTTP_AUTHORIZATION="Basic " + base64.b64encode(b"alice:pw").decode())
    assert basic.get(runs_url()).status_code == 200
    basic.credentials(HTTP_AUTHORIZATION="Basic " + base64.b64encode(b"alice:wrong").decode())
    assert basic.get(runs_url()).status_code == 401


def test_permission_classes_come_from_settings(anon: APIClient, api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"]}
    assert anon.get(runs_url()).status_code == 200
    assert anon.post(runs_url(), {"workflow": "test.fatal", "input": None}, format="json").status_code == 201
    settings.DURABLE = {**settings.DURABLE, "API_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"]}
    response = api.get(runs_url())
    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"


@pytest.mark.parametrize("configured", [["no.such.Permission"], "rest_framework.permissions.AllowAny"])
def test_misconfigured_permission_classes_say_what_to_fix(api: APIClient, settings: Any, configured: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_PERMISSION_CLASSES": configured}
    with pytest.raises(ImproperlyConfigured, match="API_PERMISSION_CLASSES"):
        api.get(runs_url())


def test_durable_views_map_their_errors_without_the_project_handler(api: APIClient, settings: Any) -> None:
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "EXCEPTION_HANDLER": "rest_framework.views.exception_handler"}
    for _ in range(3):
        start_add(api, "own")
    response = start_add(api, "own")
    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    assert api.get(run_url("nope")).json()["code"] == "run_not_found"


# -- tenant fencing ------------------------------------------------------------------


@pytest.fixture
def tenants(settings: Any, django_user_model: Any) -> tuple[APIClient, APIClient]:
    settings.DURABLE = {**settings.DURABLE, "API_NAMESPACE": TENANTS}
    clients = []
    for name in ("alice", "bob"):
        client = APIClient()
        client.force_authenticate(django_user_model.objects.create_user(username=name))
        clients.append(client)
    return clients[0], clients[1]


def start(client: APIClient, key: str, run_id: str | None = None) -> Any:
    data: dict[str, Any] = {"workflow": "test.add", "input": add_input(key)}
    if run_id is not None:
        data["run_id"] = run_id
    return client.post(runs_url(), data, format="json")


def test_runs_are_created_in_the_requests_namespace(tenants: tuple[APIClient, APIClient]) -> None:
    alice, bob = tenants
    response = start(alice, "shared", "a1")
    assert response.status_code == 201
    assert response.json()["namespace"] == "tenant-alice"
    assert models.WorkflowRun.objects.get(run_id="a1").namespace == "tenant-alice"
    assert set(models.RunTag.objects.filter(run__run_id="a1").values_list("namespace", flat=True)) == {"tenant-alice"}


def test_a_tenant_lists_and_reads_only_its_own_runs(tenants: tuple[APIClient, APIClient]) -> None:
    alice, bob = tenants
    start(alice, "shared", "a1")
    start(alice, "shared", "a2")
    start(bob, "shared", "b1")
    WorkflowRunFactory(run_id="d1")  # namespace "default"
    assert [r["run_id"] for r in alice.get(runs_url()).json()["results"]] == ["a2", "a1"]
    assert [r["run_id"] for r in bob.get(runs_url()).json()["results"]] == ["b1"]
    assert [r["run_id"] for r in bob.get(runs_url(), {"tag": "concurrency:shared"}).json()["results"]] == ["b1"]
    assert alice.get(run_url("a1")).status_code == 200
    for other in ("b1", "d1"):
        response = alice.get(run_url(other))
        assert response.status_code == 404
        assert response.json()["code"] == "run_not_found"


def test_a_tenant_cannot_cancel_another_tenants_run(tenants: tuple[APIClient, APIClient]) -> None:
    alice, bob = tenants
    start(bob, "shared", "b1")
    assert alice.post(cancel_url("b1")).status_code == 404
    assert models.WorkflowRun.objects.get(run_id="b1").status == "pending"
    assert bob.post(cancel_url("b1")).status_code == 200


def test_a_tenant_sees_only_its_own_quota_counts(tenants: tuple[APIClient, APIClient]) -> None:
    alice, bob = tenants
    start(alice, "shared")
    start(alice, "shared")
    start(bob, "shared")
    start(alice, "alice-only")
    assert alice.get(quota_url("shared")).json()["active"] == 2
    assert bob.get(quota_url("shared")).json()["active"] == 1
    assert [q["key"] for q in alice.get(quota_url()).json()["results"]] == ["alice-only", "shared"]
    assert [q["key"] for q in bob.get(quota_url()).json()["results"]] == ["shared"]
    assert bob.get(quota_url("alice-only")).status_code == 404


def test_each_tenant_has_its_own_quota(tenants: tuple[APIClient, APIClient]) -> None:
    alice, bob = tenants
    for _ in range(3):
        assert start(alice, "shared").status_code == 201
    full = start(alice, "shared")
    assert full.status_code == 429
    assert full.json()["active"] == 3
    assert start(bob, "shared").status_code == 201


def test_a_tenant_cannot_restart_or_see_another_tenants_run_id(tenants: tuple[APIClient, APIClient]) -> None:
    alice, bob = tenants
    bob.post(
        runs_url(),
        {"workflow": "test.add", "input": {"a": 1, "b": 2, "secret": "bob's"}, "run_id": "b1"},
        format="json",
    )
    before = counts()
    response = start(alice, "shared", "b1")
    assert response.status_code == 409
    assert response.json()["code"] == "run_id_taken"
    assert "bob" not in response.content.decode()
    assert counts() == before


def test_a_taken_run_id_gets_the_same_answer_whoever_holds_it(tenants: tuple[APIClient, APIClient]) -> None:
    # Run ids are global: a taken id is refused, but the answer is the same for
    # another tenant's run as for the tenant's own run of another workflow, and
    # names neither the holder, its namespace nor its workflow.
    alice, bob = tenants
    assert start(bob, "shared", "b1").status_code == 201
    assert alice.post(runs_url(), {"workflow": "test.fatal", "input": None, "run_id": "a1"}, format="json").status_code == 201
    before = counts()
    foreign, own = start(alice, "shared", "b1"), start(alice, "shared", "a1")
    assert foreign.status_code == own.status_code == 409
    assert foreign.json() == {key: value.replace("'a1'", "'b1'") for key, value in own.json().items()}
    for word in ("tenant", "namespace", "bob", "test.add", "test.fatal", "workflow"):
        assert word not in foreign.content.decode()
    assert counts() == before


def test_run_ids_of_schedules_are_reserved(tenants: tuple[APIClient, APIClient]) -> None:
    # A tenant could otherwise read another tenant's schedule windows from 409s,
    # or take a future window's run id and make that window fail.
    from durable import schedules

    alice, bob = tenants
    schedule = schedules.create_schedule("nightly", "test.add", {"a": 1, "b": 2}, cron="0 3 * * *", namespace="tenant-bob")
    past = schedules.fire(schedule.pk)
    assert past is not None and past.started
    future = schedules.window_run_id("nightly", past.window + timedelta(days=1))
    before = counts()
    for run_id in (past.run_id, future, "schedule:anything"):
        response = start(alice, "shared", run_id)
        assert response.status_code == 400, response.json()
        assert "reserved" in response.json()["run_id"][0]
    assert start(bob, "shared", future).status_code == 400  # the holder's tenant included
    assert counts() == before
    nxt = schedules.fire(schedule.pk, now=past.window + timedelta(days=1, minutes=1))
    assert nxt is not None and nxt.started and nxt.run_id == future


def test_a_user_without_namespace_is_refused(settings: Any, django_user_model: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_NAMESPACE": TENANTS}
    client = APIClient()
    client.force_authenticate(django_user_model.objects.create_user(username="nobody"))
    WorkflowRunFactory(run_id="d1")
    response = client.get(runs_url())
    assert response.status_code == 403
    assert "namespace" in response.json()["detail"]
    assert client.post(runs_url(), {"workflow": "test.fatal", "input": None}, format="json").status_code == 403
    assert models.WorkflowRun.objects.count() == 1


def test_unauthenticated_requests_are_refused_before_the_namespace_function(anon: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_NAMESPACE": "tests.api.tenants.broken"}
    assert anon.get(runs_url()).status_code in (401, 403)


@pytest.mark.parametrize("configured", ["tests.api.tenants.broken", "tests.api.tenants.missing"])
def test_a_broken_namespace_setting_says_what_to_fix(api: APIClient, settings: Any, configured: str) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_NAMESPACE": configured}
    with pytest.raises(ImproperlyConfigured, match="API_NAMESPACE"):
        api.get(runs_url())
