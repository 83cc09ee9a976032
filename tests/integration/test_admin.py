"""The Django admin of durable: runs (filters, search, change page, actions) and quotas."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.http import HttpResponse
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable import models
from durable.status import RunStatus
from durable.testing import RunTagFactory, StepRecordFactory, WorkflowRunFactory, tagged

pytestmark = pytest.mark.django_db

RUNS_URL = reverse("admin:durable_workflowrun_changelist")
QUOTAS_URL = reverse("admin:durable_concurrencylock_changelist")


def run_url(run: models.WorkflowRun) -> str:
    return reverse("admin:durable_workflowrun_change", args=[run.pk])


def quota_url(key: str) -> str:
    return reverse("admin:durable_concurrencylock_change", args=[quote(key)])


def listed(response: HttpResponse) -> list[str]:
    """Run ids (or quota keys) of the changelist page, in order."""
    assert response.status_code == 200
    return [getattr(obj, "run_id", None) or obj.pk for obj in response.context["cl"].result_list]


def messages_of(response: HttpResponse) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def act(client: Client, action: str, *runs: models.WorkflowRun) -> HttpResponse:
    return client.post(RUNS_URL, {"action": action, "_selected_action": [r.pk for r in runs]})


def add_run(status: str, key: str, **fields: Any) -> models.WorkflowRun:
    """A run of the registered ``test.add`` workflow (quota: 3 per input["key"])."""
    run = WorkflowRunFactory(workflow="test.add", version="1", status=status, input={"key": key, "a": 1, "b": 2}, **fields)
    tagged(run, f"concurrency:{key}")
    return run


# -- runs: changelist --------------------------------------------------------------


def test_changelist_lists_runs_newest_first(admin_client: Client) -> None:
    old = WorkflowRunFactory(created_at=timezone.now() - timedelta(hours=1))
    new = WorkflowRunFactory()
    response = admin_client.get(RUNS_URL)
    assert listed(response) == [new.run_id, old.run_id]
    assert b"field-status_mark" in response.content and b"field-finished" in response.content


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"status__exact": "failed"}, "failed"),
        ({"workflow": "billing.charge"}, "billing"),
        ({"namespace": "eu"}, "eu"),
    ],
)
def test_each_filter(admin_client: Client, query: dict[str, str], expected: str) -> None:
    runs = {
        "plain": WorkflowRunFactory(),
        "failed": WorkflowRunFactory(status=RunStatus.FAILED),
        "billing": WorkflowRunFactory(workflow="billing.charge"),
        "eu": WorkflowRunFactory(namespace="eu"),
    }
    assert listed(admin_client.get(RUNS_URL, query)) == [runs[expected].run_id]


def test_filter_choices_offer_workflows_and_namespaces(admin_client: Client) -> None:
    WorkflowRunFactory(workflow="billing.charge", namespace="eu")
    content = admin_client.get(RUNS_URL).content.decode()
    # The links the filters offer are the parameters test_each_filter uses.
    assert '?workflow=billing.charge"' in content
    assert '?namespace=eu"' in content
    assert '?status__exact=failed"' in content


def test_search_by_run_id(admin_client: Client) -> None:
    wanted = WorkflowRunFactory(run_id="order-7781-turn")
    WorkflowRunFactory(run_id="order-9999-turn")
    assert listed(admin_client.get(RUNS_URL, {"q": "7781"})) == [wanted.run_id]


def test_search_by_tag_lists_each_run_once(admin_client: Client) -> None:
    wanted = WorkflowRunFactory()
    # Two tags matching the search: the run must still appear once.
    tagged(wanted, "concurrency:tenant:acme", "team:acme")
    tagged(WorkflowRunFactory(), "concurrency:tenant:globex")
    response = admin_client.get(RUNS_URL, {"q": "acme"})
    assert listed(response) == [wanted.run_id]
    assert response.context["cl"].result_count == 1


def test_search_with_several_words_needs_all_of_them(admin_client: Client) -> None:
    both = WorkflowRunFactory(run_id="turn-1")
    tagged(both, "concurrency:tenant:acme")
    tagged(WorkflowRunFactory(run_id="turn-2"), "concurrency:tenant:globex")
    assert listed(admin_client.get(RUNS_URL, {"q": "turn acme"})) == [both.run_id]


def test_tag_filter_is_exact(admin_client: Client) -> None:
    wanted = WorkflowRunFactory()
    tagged(wanted, "concurrency:acme")
    tagged(WorkflowRunFactory(), "concurrency:acme-eu")
    response = admin_client.get(RUNS_URL, {"tag": "concurrency:acme"})
    assert listed(response) == [wanted.run_id]


def test_changelist_does_not_load_json_columns(admin_client: Client) -> None:
    WorkflowRunFactory(input={"big": "x" * 100})
    [run] = admin_client.get(RUNS_URL).context["cl"].result_list
    assert {"input", "output", "error"} <= run.get_deferred_fields()


# -- runs: change page -------------------------------------------------------------


def test_change_page_shows_input_output_error_tags_and_steps(admin_client: Client) -> None:
    run = WorkflowRunFactory(
        status=RunStatus.FAILED,
        input={"tenant_id": "acme", "message": "hello <b>"},
        output={"reply": "bonjour"},
        error={"type": "builtins.ValueError", "message": "bad reply"},
    )
    tagged(run, "concurrency:tenant:acme")
    # Created out of order: the page lists them by position.
    StepRecordFactory(run=run, position=1, name="send-reply", output={"sent": True})
    StepRecordFactory(
        run=run,
        position=0,
        name="generate-reply",
        outcome="failed",
        attempts=3,
        output=None,
        error={"message": "model timed out"},
    )
    response = admin_client.get(run_url(run))
    assert response.status_code == 200
    content = response.content.decode()
    assert "&quot;tenant_id&quot;: &quot;acme&quot;" in content  # indented JSON, escaped
    assert "hello &lt;b&gt;" in content and "hello <b>" not in content
    assert "&quot;reply&quot;: &quot;bonjour&quot;" in content
    assert "bad reply" in content
    assert content.index("generate-reply") < content.index("send-reply")
    assert "model timed out" in content and "&quot;sent&quot;: true" in content
    assert "concurrency:tenant:acme" in content
    assert quota_url("tenant:acme") in content


def test_change_page_is_read_only(admin_client: Client) -> None:
    run = WorkflowRunFactory(workflow="a.b")
    response = admin_client.get(run_url(run))
    assert response.status_code == 200
    assert b'name="_save"' not in response.content
    assert b'name="workflow"' not in response.content
    assert admin_client.post(run_url(run), {"workflow": "changed"}).status_code == 403
    run.refresh_from_db()
    assert run.workflow == "a.b"


def test_runs_cannot_be_added_or_deleted(admin_client: Client) -> None:
    run = WorkflowRunFactory(status=RunStatus.COMPLETED)
    assert admin_client.get(reverse("admin:durable_workflowrun_add")).status_code == 403
    assert admin_client.post(reverse("admin:durable_workflowrun_delete", args=[run.pk])).status_code == 403
    response = admin_client.get(RUNS_URL)
    assert b"delete_selected" not in response.content
    assert models.WorkflowRun.objects.filter(pk=run.pk).exists()


def test_view_only_staff_sees_steps_but_no_actions() -> None:
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_workflowrun"))
    client = Client()
    client.force_login(user)
    run = WorkflowRunFactory()
    StepRecordFactory(run=run, name="visible-step")
    changelist = client.get(RUNS_URL)
    assert listed(changelist) == [run.run_id]
    assert b"cancel_runs" not in changelist.content
    assert b"visible-step" in client.get(run_url(run)).content
    response = act(client, "cancel_runs", run)
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    assert response.status_code == 200  # no action ran: the page is shown again


# -- runs: cancel action -----------------------------------------------------------


def test_cancel_action_cancels_active_runs_and_reports_finished_ones(admin_client: Client) -> None:
    pending = WorkflowRunFactory(status=RunStatus.PENDING)
    running = WorkflowRunFactory(status=RunStatus.RUNNING)
    tagged(running, "concurrency:tenant:acme")
    completed = WorkflowRunFactory(status=RunStatus.COMPLETED)

    response = act(admin_client, "cancel_runs", pending, running, completed)

    assert response.status_code == 302
    for run in (pending, running, completed):
        run.refresh_from_db()
    assert (pending.status, running.status) == (RunStatus.CANCELLED, RunStatus.CANCELLED)
    assert completed.status == RunStatus.COMPLETED
    # The slot is freed: the tag mirrors the new status.
    assert models.RunTag.objects.get(run=running).status == RunStatus.CANCELLED
    notes = messages_of(response)
    assert "Cancelled 2 runs." in notes
    assert any(f"{completed.run_id} (completed)" in n and "already finished" in n for n in notes)
    # Who cancelled what is in the runs' history.
    logged = LogEntry.objects.filter(change_message="Cancelled through the admin.")
    assert sorted(int(e.object_id) for e in logged) == sorted([pending.pk, running.pk])


def test_cancel_action_on_finished_runs_only(admin_client: Client) -> None:
    failed = WorkflowRunFactory(status=RunStatus.FAILED)
    response = act(admin_client, "cancel_runs", failed)
    assert response.status_code == 302
    notes = messages_of(response)
    assert notes == [f"1 run had already finished and was left as it was: {failed.run_id} (failed)."]
    failed.refresh_from_db()
    assert failed.status == RunStatus.FAILED


# -- runs: retry action ------------------------------------------------------------


def test_retry_action_restarts_a_failed_run(admin_client: Client, django_capture_on_commit_callbacks: Any) -> None:
    run = add_run(RunStatus.FAILED, "retry-ok", attempt=2, error={"message": "boom"})
    StepRecordFactory(run=run, position=0, name="add", outcome="failed")

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = act(admin_client, "retry_runs", run)

    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    assert (run.attempt, run.error) == (0, None)
    assert models.RunTag.objects.get(run=run).status == RunStatus.PENDING
    assert not run.steps.exists()  # the failed step runs again
    assert len(callbacks) == 1  # handed to a worker on commit
    assert messages_of(response) == ["Retried 1 run: it is pending again."]
    assert LogEntry.objects.get(change_message="Retried through the admin.").object_id == str(run.pk)


def test_retry_action_reports_a_full_quota(admin_client: Client) -> None:
    for _ in range(3):  # test.add allows 3 in flight per key
        add_run(RunStatus.RUNNING, "retry-full")
    run = add_run(RunStatus.FAILED, "retry-full")

    response = act(admin_client, "retry_runs", run)

    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    [note] = messages_of(response)
    assert note.startswith(f"Could not retry run {run.run_id}: ")
    assert "'retry-full'" in note and "3 of 3" in note


def test_retry_action_fills_the_quota_oldest_first(admin_client: Client) -> None:
    add_run(RunStatus.RUNNING, "retry-two")
    now = timezone.now()
    older = add_run(RunStatus.CANCELLED, "retry-two", created_at=now - timedelta(minutes=3))
    old = add_run(RunStatus.DEAD, "retry-two", created_at=now - timedelta(minutes=2))
    newest = add_run(RunStatus.FAILED, "retry-two", created_at=now - timedelta(minutes=1))

    response = act(admin_client, "retry_runs", newest, old, older)

    statuses = {r.run_id: r.status for r in models.WorkflowRun.objects.filter(pk__in=[older.pk, old.pk, newest.pk])}
    assert statuses == {older.run_id: "pending", old.run_id: "pending", newest.run_id: "failed"}
    notes = messages_of(response)
    assert "Retried 2 runs: they are pending again." in notes
    assert any(newest.run_id in n and "Concurrency limit" in n for n in notes)


def test_retry_action_reports_runs_that_cannot_be_retried(admin_client: Client) -> None:
    completed = add_run(RunStatus.COMPLETED, "retry-no")
    running = add_run(RunStatus.RUNNING, "retry-no")
    response = act(admin_client, "retry_runs", completed, running)
    assert response.status_code == 302
    [note] = messages_of(response)
    assert note.startswith("2 runs were not retried: only failed, dead or cancelled runs can be retried")
    assert f"{completed.run_id} (completed)" in note and f"{running.run_id} (running)" in note
    completed.refresh_from_db()
    assert completed.status == RunStatus.COMPLETED


def test_retry_action_reports_an_unregistered_workflow(admin_client: Client) -> None:
    run = WorkflowRunFactory(workflow="test.add", version="0-gone", status=RunStatus.FAILED)
    response = act(admin_client, "retry_runs", run)
    assert response.status_code == 302
    [note] = messages_of(response)
    assert run.run_id in note and "'0-gone' is not registered" in note
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED


# -- quotas -------------------------------------------------------------------------


def _row(content: str, key: str) -> str:
    """The HTML of the changelist row of ``key``."""
    start = content.index(f">{key}</a>")
    return content[start : content.index("</tr>", start)]


def test_quotas_changelist_shows_counts_limit_and_oldest(admin_client: Client) -> None:
    models.ConcurrencyLock.objects.create(key="tenant:acme", limit=3, count_statuses=["pending", "running"])
    models.ConcurrencyLock.objects.create(key="tenant:new", limit=None)
    oldest = timezone.now() - timedelta(hours=2)
    tagged(WorkflowRunFactory(status=RunStatus.RUNNING, created_at=oldest), "concurrency:tenant:acme")
    tagged(WorkflowRunFactory(status=RunStatus.PENDING), "concurrency:tenant:acme")
    tagged(WorkflowRunFactory(status=RunStatus.QUEUED, created_at=oldest), "concurrency:tenant:acme")
    # Neither finished nor suspended runs count here (suspended is not in count_statuses).
    finished = WorkflowRunFactory(status=RunStatus.COMPLETED, created_at=oldest - timedelta(days=1))
    tagged(finished, "concurrency:tenant:acme")
    tagged(WorkflowRunFactory(status=RunStatus.SUSPENDED), "concurrency:tenant:acme")

    response = admin_client.get(QUOTAS_URL)
    assert listed(response) == ["tenant:acme", "tenant:new"]
    content = response.content.decode()
    acme = _row(content, "tenant:acme")
    assert '<span class="durable-use-count">2 / 3</span>' in acme
    assert '<td class="field-queued"><span class="durable-queued">1</span></td>' in acme
    assert ">waiting 2h 0m</span>" in acme or ">waiting 2h</span>" in acme
    assert ">2h 0m ago</span>" in acme or ">2h ago</span>" in acme
    assert "pending, running" in acme
    assert "?tag=concurrency%3Atenant%3Aacme" in acme
    new = _row(content, "tenant:new")
    assert '<span class="durable-use">0 / ?</span>' in new  # limit not known
    assert '<td class="field-oldest_in_flight">—</td>' in new
    assert '<td class="field-oldest_queued">—</td>' in new


def test_quotas_changelist_query_count_does_not_grow_with_keys(admin_client: Client, django_assert_max_num_queries: Any) -> None:
    for i in range(25):
        models.ConcurrencyLock.objects.create(key=f"tenant:{i}", limit=5)
        run = WorkflowRunFactory(status=RunStatus.RUNNING)
        RunTagFactory(run=run, tag=f"concurrency:tenant:{i}")
    admin_client.get(QUOTAS_URL)  # warm the session and content-type caches
    with django_assert_max_num_queries(9):
        response = admin_client.get(QUOTAS_URL)
    assert len(listed(response)) == 25
    assert response.content.decode().count('<span class="durable-use-count">1 / 5</span>') == 25


def test_quota_link_lists_the_runs_of_its_key(admin_client: Client) -> None:
    models.ConcurrencyLock.objects.create(key="tenant:acme", limit=3)
    wanted = WorkflowRunFactory()
    tagged(wanted, "concurrency:tenant:acme")
    tagged(WorkflowRunFactory(), "concurrency:tenant:acme-eu")
    content = admin_client.get(QUOTAS_URL).content.decode()
    start = content.index('href="/admin/durable/workflowrun/?tag=')
    href = content[start + len('href="') : content.index('"', start + len('href="'))]
    assert listed(admin_client.get(href.replace("&amp;", "&"))) == [wanted.run_id]


def test_quota_change_page_is_read_only_with_counts(admin_client: Client) -> None:
    models.ConcurrencyLock.objects.create(key="tenant:acme", limit=4)
    for status in (RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.FAILED):
        tagged(WorkflowRunFactory(status=status), "concurrency:tenant:acme")
    response = admin_client.get(quota_url("tenant:acme"))
    assert response.status_code == 200
    content = response.content.decode()
    assert b'name="_save"' not in response.content
    # running and suspended occupy a slot by default; failed does not.
    assert '<div class="readonly">2</div>' in content
    assert '<div class="readonly">4 (from the code)' in content
    assert '<span class="durable-use-count">2 / 4</span>' in content
    assert admin_client.get(reverse("admin:durable_concurrencylock_add")).status_code == 403
    delete_url = reverse("admin:durable_concurrencylock_delete", args=[quote("tenant:acme")])
    assert admin_client.post(delete_url).status_code == 403
    assert models.ConcurrencyLock.objects.filter(key="tenant:acme").exists()


# -- big lists -------------------------------------------------------------------------


def test_quotas_changelist_counts_only_the_page_keys(admin_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from durable.admin import ConcurrencyQuotaAdmin

    monkeypatch.setattr(ConcurrencyQuotaAdmin, "list_per_page", 2)
    for i in range(5):
        models.ConcurrencyLock.objects.create(key=f"k{i}", limit=5)
        tagged(WorkflowRunFactory(status=RunStatus.RUNNING), f"concurrency:k{i}")
    with CaptureQueriesContext(connection) as captured:
        response = admin_client.get(QUOTAS_URL, {"p": "2"})
    assert listed(response) == ["k2", "k3"]
    assert response.content.decode().count('<span class="durable-use-count">1 / 5</span>') == 2
    # The page's counts: one query naming the page's keys only.
    counted = [q["sql"] for q in captured.captured_queries if "concurrency:k2" in q["sql"]]
    assert len(counted) == 1
    assert "concurrency:k0" not in counted[0] and "concurrency:k4" not in counted[0]


@pytest.mark.postgres
def test_big_run_list_is_counted_from_the_planner_estimate(admin_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from durable.admin import listing

    for i in range(300):
        WorkflowRunFactory(run_id=f"r{i}", status=RunStatus.RUNNING if i < 3 else RunStatus.COMPLETED)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE durable_workflowrun")

    def run_counts(query: dict[str, str]) -> tuple[int, list[str]]:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(RUNS_URL, query)
        assert response.status_code == 200
        counts = [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"] and "durable_workflowrun" in q["sql"]]
        return response.context["cl"].result_count, counts

    # A small list is counted exactly.
    assert run_counts({}) == (300, [run_counts({})[1][0]])
    monkeypatch.setattr(listing, "EXACT_COUNT_UP_TO", 100)
    # Above the threshold: the planner's estimate (ANALYZE saw every row), no COUNT(*).
    count, counts = run_counts({})
    assert counts == [] and abs(count - 300) <= 30
    # A filter the planner expects to match few rows is counted exactly.
    assert run_counts({"status__exact": "running"})[0] == 3


@pytest.mark.postgres
def test_workflow_and_namespace_choices_skip_through_their_index(admin_client: Client) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for i in range(30):
        WorkflowRunFactory(workflow=f"wf.{i % 3}", namespace="eu" if i % 2 else "us")
    with CaptureQueriesContext(connection) as captured:
        content = admin_client.get(RUNS_URL).content.decode()
    for value in ('?workflow=wf.0"', '?workflow=wf.2"', '?namespace=eu"', '?namespace=us"'):
        assert value in content
    choices = [q["sql"] for q in captured.captured_queries if "DISTINCT" in q["sql"] or "RECURSIVE" in q["sql"]]
    assert len(choices) == 2 and all(sql.startswith("WITH RECURSIVE") for sql in choices)
