"""Runs in the admin: keys, durations, times to the second, the executing step, and
cancel / retry buttons on a run's page."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.test import Client
from django.utils import timezone

from durable import models
from durable.status import RunStatus
from durable.testing import StepRecordFactory, WorkflowRunFactory, tagged
from tests.admin.helpers import RUNS_URL, add_run, listed, row, run_url

pytestmark = pytest.mark.django_db


def _timed_run(status: str, **fields: Any) -> models.WorkflowRun:
    start = timezone.now() - timedelta(hours=1)
    return WorkflowRunFactory(status=status, created_at=start, started_at=start + timedelta(seconds=5), **fields)


def test_the_list_shows_each_runs_keys_durations_and_seconds(admin_client: Client) -> None:
    finished = _timed_run(RunStatus.COMPLETED, run_id="done")
    models.WorkflowRun.objects.filter(pk=finished.pk).update(finished_at=finished.started_at + timedelta(minutes=4, seconds=12))
    tagged(finished, "concurrency:tenant:acme", "concurrency:region:eu", "team:a")
    running = _timed_run(RunStatus.RUNNING, run_id="busy")
    tagged(running, "concurrency:tenant:acme")
    WorkflowRunFactory(status=RunStatus.QUEUED, run_id="waiting", created_at=timezone.now() - timedelta(minutes=3))
    content = admin_client.get(RUNS_URL).content.decode()

    done = row(content, "done")
    assert ">region:eu</a><br><a" in done and ">tenant:acme</a>" in done and "team:a" not in done
    assert '<span class="durable-took">4m 12s</span>' in done
    assert re.search(r"title=\"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\">\d{4}-\d\d-\d\d<br>\d\d:\d\d:\d\d<", done)
    assert re.search(r">59m 5\ds so far<", row(content, "busy"))
    assert re.search(r">waiting 3m( [0-2]s)?<", row(content, "waiting"))
    assert "/admin/durable/concurrencylock/tenant_3Aacme/change/" in done


def test_the_keys_column_costs_one_query_per_page(admin_client: Client, django_assert_max_num_queries: Any) -> None:
    def runs(n: int) -> None:
        for _ in range(n):
            tagged(WorkflowRunFactory(status=RunStatus.RUNNING), "concurrency:tenant:acme", "concurrency:region:eu")

    runs(2)
    admin_client.get(RUNS_URL)  # warm the session and content-type caches
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as few:
        admin_client.get(RUNS_URL)
    runs(30)
    with django_assert_max_num_queries(len(few.captured_queries)):
        response = admin_client.get(RUNS_URL)
    assert response.content.decode().count(">region:eu</a>") == 32


def test_a_running_runs_page_marks_the_executing_step(admin_client: Client) -> None:
    run = _timed_run(RunStatus.RUNNING, worker="celery@w1")
    t0 = run.started_at
    StepRecordFactory(run=run, position=0, name="load", started_at=t0, finished_at=t0 + timedelta(seconds=2))
    StepRecordFactory(
        run=run,
        position=1,
        name="generate",
        attempts=2,
        started_at=t0 + timedelta(seconds=2),
        finished_at=t0 + timedelta(minutes=3, seconds=41),
    )
    content = admin_client.get(run_url(run)).content.decode()
    assert 'executing step #2, after step #1 "generate" (step #1 finished ' in content
    assert "worker celery@w1" in content
    assert "its name is journaled when it finishes" in content
    # Each step's duration and its times to the second.
    assert ">3m 39s<" in content and ">2s<" in content
    assert re.search(r"durable-time\">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC<", content)
    assert re.search(r">1h 0m so far<|>59m 5\ds so far<", content)


@pytest.mark.parametrize(
    ("status", "fields", "text"),
    [
        (RunStatus.SUSPENDED, {"waiting_for": "signal:approve"}, "suspended at step #0: waiting for signal:approve"),
        (RunStatus.QUEUED, {}, "queued for a slot of its key for"),
        (RunStatus.PENDING, {}, "pending: waiting for a worker to pick it up (next step #1)"),
        (RunStatus.BLOCKED, {"queue": "billing"}, "blocked: no live worker serves queue billing"),
    ],
)
def test_an_unfinished_runs_page_says_what_it_waits_for(
    admin_client: Client, status: str, fields: dict[str, str], text: str
) -> None:
    run = WorkflowRunFactory(status=status, **fields)
    StepRecordFactory(run=run, position=0, name="first")
    assert text in admin_client.get(run_url(run)).content.decode()


@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.CANCELLED, RunStatus.FAILED, RunStatus.DEAD])
def test_a_finished_runs_page_has_no_now_row(admin_client: Client, status: str) -> None:
    finished = admin_client.get(run_url(WorkflowRunFactory(status=status))).content.decode()
    running = admin_client.get(run_url(WorkflowRunFactory(status=RunStatus.RUNNING))).content.decode()
    assert "field-current_step" not in finished
    assert "field-current_step" in running


# -- cancel and retry buttons ----------------------------------------------------------------


def test_buttons_match_the_runs_status(admin_client: Client) -> None:
    running = WorkflowRunFactory(status=RunStatus.RUNNING)
    failed = WorkflowRunFactory(status=RunStatus.FAILED)
    completed = WorkflowRunFactory(status=RunStatus.COMPLETED)
    page = admin_client.get(run_url(running)).content.decode()
    assert run_url(running, "cancel") in page and run_url(running, "retry") not in page
    page = admin_client.get(run_url(failed)).content.decode()
    assert run_url(failed, "retry") in page and run_url(failed, "cancel") not in page
    page = admin_client.get(run_url(completed)).content.decode()
    assert run_url(completed, "retry") not in page and run_url(completed, "cancel") not in page


def test_cancel_asks_first_then_cancels_on_post(admin_client: Client) -> None:
    run = WorkflowRunFactory(status=RunStatus.RUNNING, run_id="turn-1")
    tagged(run, "concurrency:tenant:acme")
    confirm = admin_client.get(run_url(run, "cancel"))
    assert confirm.status_code == 200
    page = confirm.content.decode()
    assert "Cancel this run?" in page and 'method="post"' in page and "csrfmiddlewaretoken" in page
    assert "Yes, cancel this run" in page and "quota: concurrency:tenant:acme" in page
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING  # a GET changes nothing

    response = admin_client.post(run_url(run, "cancel"))
    assert response.status_code == 302 and response["Location"] == run_url(run)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert models.RunTag.objects.get(run=run).status == RunStatus.CANCELLED  # its slot is free
    assert [str(m) for m in get_messages(response.wsgi_request)] == ["Cancelled 1 run."]
    assert LogEntry.objects.get(change_message="Cancelled through the admin.").object_id == str(run.pk)


def test_cancel_of_a_finished_run_says_so(admin_client: Client) -> None:
    run = WorkflowRunFactory(status=RunStatus.COMPLETED)
    response = admin_client.post(run_url(run, "cancel"))
    assert response.status_code == 302
    [note] = [str(m) for m in get_messages(response.wsgi_request)]
    assert "already finished" in note
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED


def test_retry_asks_first_then_retries_under_the_quota(admin_client: Client, django_capture_on_commit_callbacks: Any) -> None:
    run = add_run(RunStatus.FAILED, "button-retry", attempt=2, error={"message": "boom"})
    assert "Retry this run?" in admin_client.get(run_url(run, "retry")).content.decode()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = admin_client.post(run_url(run, "retry"))
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING and len(callbacks) == 1
    assert [str(m) for m in get_messages(response.wsgi_request)] == ["Retried 1 run: it is pending again."]


def test_retry_refused_by_a_full_quota_leaves_the_run(admin_client: Client) -> None:
    for _ in range(3):  # test.add allows 3 in flight per key
        add_run(RunStatus.RUNNING, "button-full")
    run = add_run(RunStatus.FAILED, "button-full")
    response = admin_client.post(run_url(run, "retry"))
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    [note] = [str(m) for m in get_messages(response.wsgi_request)]
    assert note.startswith(f"Could not retry run {run.run_id}: ") and "3 of 3" in note


def test_buttons_need_the_change_permission() -> None:
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_workflowrun"))
    client = Client()
    client.force_login(viewer)
    run = WorkflowRunFactory(status=RunStatus.RUNNING)
    page = client.get(run_url(run)).content.decode()
    assert page and run_url(run, "cancel") not in page
    assert client.get(run_url(run, "cancel")).status_code == 403
    assert client.post(run_url(run, "cancel")).status_code == 403
    assert client.post(run_url(run, "retry")).status_code == 403
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING


def test_a_post_without_the_csrf_token_is_refused(admin_user: User) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    run = WorkflowRunFactory(status=RunStatus.RUNNING)
    assert client.post(run_url(run, "cancel")).status_code == 403
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING


def test_a_missing_run_is_404(admin_client: Client) -> None:
    assert admin_client.get("/admin/durable/workflowrun/999999/cancel/").status_code == 404


def test_the_list_still_filters_and_searches(admin_client: Client) -> None:
    wanted = WorkflowRunFactory(run_id="order-7781")
    tagged(wanted, "concurrency:tenant:acme")
    WorkflowRunFactory(run_id="order-9999")
    assert listed(admin_client.get(RUNS_URL, {"q": "acme"})) == ["order-7781"]
