"""GET/POST schedules/, GET schedules/<name>/, POST schedules/<name>/pause/ and resume/."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse
from django_celery_beat.models import PeriodicTask
from rest_framework.test import APIClient

from durable import models, schedules

pytestmark = pytest.mark.django_db

TENANTS = "tests.api.tenants.by_username"


def list_url() -> str:
    return reverse("durable:schedule-list")


def detail_url(name: str) -> str:
    return reverse("durable:schedule-detail", args=[name])


def pause_url(name: str) -> str:
    return reverse("durable:schedule-pause", args=[name])


def resume_url(name: str) -> str:
    return reverse("durable:schedule-resume", args=[name])


def body(**fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"name": "digest", "workflow": "test.add", "input": {"a": 1, "b": 2}, "cron": "0 9 * * *"}
    data.update(fields)
    return {k: v for k, v in data.items() if v is not None}


def create(client: APIClient, **fields: Any) -> Any:
    return client.post(list_url(), body(**fields), format="json")


def test_urls() -> None:
    assert list_url() == "/durable/schedules/"
    assert detail_url("digest") == "/durable/schedules/digest/"
    assert pause_url("digest") == "/durable/schedules/digest/pause/"
    assert resume_url("digest") == "/durable/schedules/digest/resume/"


@pytest.mark.parametrize("method_url", ["get list", "post list", "get detail", "post pause", "post resume"])
def test_unauthenticated_requests_are_refused(anon: APIClient, method_url: str) -> None:
    schedules.create_schedule("digest", "test.add", {}, every=60)
    method, which = method_url.split()
    url = {"list": list_url(), "detail": detail_url("digest"), "pause": pause_url("digest"), "resume": resume_url("digest")}[
        which
    ]
    response = getattr(anon, method)(url, body(name="other"), format="json")
    assert response.status_code in (401, 403)
    assert response.json()["code"] == "not_authenticated"
    assert list(models.Schedule.objects.values_list("name", "enabled")) == [("digest", True)]


def test_create_answers_201_with_the_schedule_and_its_beat_entry(api: APIClient) -> None:
    response = create(api, timezone="Europe/Paris", concurrency_key="tenant:acme", concurrency_limit=8)
    assert response.status_code == 201, response.json()
    data = response.json()
    expected = {
        "name": "digest",
        "workflow": "test.add",
        "input": {"a": 1, "b": 2},
        "cron": "0 9 * * *",
        "every": None,
        "timezone": "Europe/Paris",
        "enabled": True,
        "namespace": "default",
        "concurrency_key": "tenant:acme",
        "concurrency_limit": 8,
        "last_run_at": None,
        "last_run_id": "",
        "last_error": "",
        "last_error_at": None,
    }
    assert {k: data[k] for k in expected} == expected
    assert data["created_at"] and data["updated_at"]
    task = PeriodicTask.objects.get()
    assert task.name == "durable-schedule:digest" and task.enabled


def test_create_an_interval_schedule_with_defaults(api: APIClient) -> None:
    response = api.post(list_url(), {"name": "tick", "workflow": "test.fatal", "every": 90}, format="json")
    assert response.status_code == 201, response.json()
    data = response.json()
    assert (data["every"], data["cron"], data["input"], data["timezone"], data["enabled"]) == (90, "", {}, "UTC", True)
    assert PeriodicTask.objects.get().interval.every == 90


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"cron": "61 * * * *"}, "cron", "Invalid cron expression '61 * * * *'"),
        ({"every": 60}, "cron", "not both"),
        ({"every": 60}, "every", "not both"),
        ({"cron": None}, "every", "needs one of them"),
        ({"cron": None, "every": 0}, "every", "from 1 to"),
        ({"cron": None, "every": 2.5}, "every", "A valid integer is required."),
        ({"cron": None, "every": 1}, "every", "at least 60 seconds (SCHEDULE_MIN_INTERVAL)"),
        ({"workflow": "no.such"}, "workflow", "No workflow is registered under the name 'no.such'"),
        ({"timezone": "Mars/Olympus"}, "timezone", "Unknown timezone 'Mars/Olympus'"),
        ({"concurrency_key": "k"}, "concurrency_limit", "needs a limit"),
        ({"concurrency_key": "k", "concurrency_limit": "many"}, "concurrency_limit", "A valid integer is required."),
        ({"concurrency_limit": 3}, "concurrency_key", "needs a concurrency key"),
        ({"name": "a b"}, "name", "A schedule name must be"),
        ({"name": 7}, "name", "Must be a string."),
        ({"input": {"x": "nul \u0000"}}, "input", "NUL"),
        ({"namespace": "other"}, "namespace", "Unknown field"),
        ({"cronn": "0 9 * * *"}, "cronn", "Unknown field"),
    ],
)
def test_bad_settings_answer_400_and_create_nothing(api: APIClient, fields: dict[str, Any], field: str, message: str) -> None:
    response = create(api, **fields)
    assert response.status_code == 400
    errors = response.json()
    assert any(message in m for m in errors[field]), errors
    assert models.Schedule.objects.count() == 0 and PeriodicTask.objects.count() == 0


def test_a_taken_name_answers_400(api: APIClient) -> None:
    assert create(api).status_code == 201
    response = create(api, cron="0 10 * * *")
    assert response.status_code == 400
    assert response.json()["name"] == ["The schedule name 'digest' is taken: choose another name."]
    assert models.Schedule.objects.get().cron == "0 9 * * *"


def test_a_name_taken_by_another_tenant_gets_the_same_answer(settings: Any, django_user_model: Any) -> None:
    # Schedule names are global: the answer says the name is taken, the same for a
    # name of the tenant's own as for another tenant's, and nothing about the holder.
    settings.DURABLE = {**settings.DURABLE, "API_NAMESPACE": TENANTS}
    alice, bob = APIClient(), APIClient()
    alice.force_authenticate(django_user_model.objects.create_user(username="alice"))
    bob.force_authenticate(django_user_model.objects.create_user(username="bob"))
    assert create(bob, name="digest").status_code == 201
    assert create(alice, name="mine").status_code == 201
    foreign, own = create(alice, name="digest"), create(alice, name="mine")
    assert foreign.status_code == own.status_code == 400
    assert foreign.json() == {"name": [own.json()["name"][0].replace("'mine'", "'digest'")]}
    assert "exists" not in foreign.content.decode() and "bob" not in foreign.content.decode()
    assert models.Schedule.objects.get(name="digest").namespace == "tenant-bob"


def test_list_and_detail(api: APIClient) -> None:
    create(api, name="b-digest")
    create(api, name="a-digest")
    response = api.get(list_url())
    assert response.status_code == 200
    assert [s["name"] for s in response.json()["results"]] == ["a-digest", "b-digest"]
    detail = api.get(detail_url("a-digest"))
    assert detail.status_code == 200 and detail.json()["name"] == "a-digest"


@pytest.mark.parametrize("name", ["ghost", "x" * 300])
def test_unknown_schedules_answer_404(api: APIClient, name: str) -> None:
    for response in (api.get(detail_url(name)), api.post(pause_url(name)), api.post(resume_url(name))):
        assert response.status_code == 404
        assert response.json()["code"] == "schedule_not_found"


def test_pause_and_resume(api: APIClient) -> None:
    create(api)
    response = api.post(pause_url("digest"))
    assert response.status_code == 200 and response.json()["enabled"] is False
    assert not models.Schedule.objects.get().enabled and not PeriodicTask.objects.get().enabled
    assert api.post(pause_url("digest")).json()["enabled"] is False  # pausing twice is fine
    response = api.post(resume_url("digest"))
    assert response.status_code == 200 and response.json()["enabled"] is True
    assert models.Schedule.objects.get().enabled and PeriodicTask.objects.get().enabled
    assert api.get(pause_url("digest")).status_code == 405


def test_last_error_shows_in_the_api(api: APIClient) -> None:
    create(api, cron=None, every=60, concurrency_key="sched:full", concurrency_limit=0)
    schedules.fire(models.Schedule.objects.get().pk)
    data = api.get(detail_url("digest")).json()
    assert "skipped" in data["last_error"] and "'sched:full'" in data["last_error"]
    assert data["last_error_at"] is not None


def test_tenants_see_and_manage_only_their_schedules(settings: Any, django_user_model: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_NAMESPACE": TENANTS}
    alice, bob = APIClient(), APIClient()
    alice.force_authenticate(django_user_model.objects.create_user(username="alice"))
    bob.force_authenticate(django_user_model.objects.create_user(username="bob"))
    schedules.create_schedule("default-digest", "test.add", {}, every=60)  # outside any tenant

    response = create(alice, name="alice-digest")
    assert response.status_code == 201 and response.json()["namespace"] == "tenant-alice"
    assert models.Schedule.objects.get(name="alice-digest").namespace == "tenant-alice"
    assert create(bob, name="bob-digest").status_code == 201

    assert [s["name"] for s in alice.get(list_url()).json()["results"]] == ["alice-digest"]
    assert [s["name"] for s in bob.get(list_url()).json()["results"]] == ["bob-digest"]
    for response in (
        bob.get(detail_url("alice-digest")),
        bob.post(pause_url("alice-digest")),
        bob.post(resume_url("alice-digest")),
        alice.post(pause_url("default-digest")),
    ):
        assert response.status_code == 404
    assert models.Schedule.objects.get(name="alice-digest").enabled
    assert models.Schedule.objects.get(name="default-digest").enabled
    assert alice.post(pause_url("alice-digest")).json()["enabled"] is False

    # A run of a tenant's schedule is created in the tenant's namespace.
    firing = schedules.run_now("alice-digest")
    assert models.WorkflowRun.objects.get(run_id=firing.run_id).namespace == "tenant-alice"
