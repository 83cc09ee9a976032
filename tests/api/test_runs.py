"""GET runs/, GET runs/<id>/, POST runs/<id>/cancel/."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from durable import engine, models
from durable.testing import StepRecordFactory, WorkflowRunFactory, tagged, wait_for
from tests.api.helpers import add_input, cancel_url, run_url, runs_url, start_add

pytestmark = pytest.mark.django_db


def ids(response: Any) -> list[str]:
    return [run["run_id"] for run in response.json()["results"]]


def test_urls_are_mounted_where_the_contract_says() -> None:
    assert runs_url() == "/durable/runs/"
    assert run_url("a/b") == "/durable/runs/a/b/"
    assert cancel_url("r1") == "/durable/runs/r1/cancel/"


def test_list_is_newest_first(api: APIClient) -> None:
    for run_id in ("first", "second", "third"):
        WorkflowRunFactory(run_id=run_id)
    response = api.get(runs_url())
    assert response.status_code == 200
    assert set(response.json()) == {"next", "previous", "results"}  # a cursor page: no count
    assert ids(response) == ["third", "second", "first"]


def test_list_is_paginated_by_the_page_size_setting(api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_PAGE_SIZE": 2}
    for i in range(5):
        WorkflowRunFactory(run_id=f"r{i}")
    first = api.get(runs_url())
    assert ids(first) == ["r4", "r3"]
    assert first.json()["previous"] is None
    second = api.get(first.json()["next"])
    assert ids(second) == ["r2", "r1"]
    last = api.get(second.json()["next"])
    assert ids(last) == ["r0"]
    assert last.json()["next"] is None
    assert ids(api.get(last.json()["previous"])) == ["r2", "r1"]
    bad = api.get(runs_url(), {"cursor": "nope"})
    assert (bad.status_code, bad.json()) == (404, {"detail": "Invalid cursor", "code": "not_found"})


def test_runs_created_in_the_same_instant_are_each_listed_once(api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "API_PAGE_SIZE": 2}
    at = timezone.now()
    for i in range(5):
        WorkflowRunFactory(run_id=f"r{i}", created_at=at)
    seen: list[str] = []
    url: str | None = runs_url()
    page: dict[str, Any] = {}
    while url:
        page = api.get(url).json()
        seen += [run["run_id"] for run in page["results"]]
        url = page["next"]
    assert seen == ["r4", "r3", "r2", "r1", "r0"]  # ties broken by id, newest first
    # And back from the last page, each run once again.
    back = [run["run_id"] for run in page["results"]]
    url = page["previous"]
    while url:
        page = api.get(url).json()
        back = [run["run_id"] for run in page["results"]] + back
        url = page["previous"]
    assert back == seen


def test_list_filters_by_workflow(api: APIClient) -> None:
    WorkflowRunFactory(run_id="a1", workflow="test.add")
    WorkflowRunFactory(run_id="f1", workflow="test.fatal")
    assert ids(api.get(runs_url(), {"workflow": "test.fatal"})) == ["f1"]
    assert ids(api.get(runs_url(), {"workflow": "nope"})) == []


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status=running", {"running"}),
        ("status=running&status=failed", {"running", "failed"}),
        ("status=running,failed", {"running", "failed"}),
        ("status=running,%20failed,", {"running", "failed"}),
        ("status=", {"pending", "running", "failed", "completed"}),
    ],
)
def test_list_filters_by_status(api: APIClient, query: str, expected: set[str]) -> None:
    for status in ("pending", "running", "failed", "completed"):
        WorkflowRunFactory(run_id=status, status=status)
    response = api.get(f"{runs_url()}?{query}")
    assert response.status_code == 200
    assert {run["status"] for run in response.json()["results"]} == expected


@pytest.mark.parametrize("query", ["status=bogus", "status=running,bogus", "status=running&status=RUNNING"])
def test_unknown_status_filter_is_400(api: APIClient, query: str) -> None:
    WorkflowRunFactory(status="running")
    response = api.get(f"{runs_url()}?{query}")
    assert response.status_code == 400
    assert "status" in response.json()


def test_list_filters_by_tag(api: APIClient) -> None:
    tagged(WorkflowRunFactory(run_id="acme-1"), "concurrency:tenant:acme")
    tagged(WorkflowRunFactory(run_id="acme-2", status="completed"), "concurrency:tenant:acme", "other")
    tagged(WorkflowRunFactory(run_id="globex"), "concurrency:tenant:globex")
    assert ids(api.get(runs_url(), {"tag": "concurrency:tenant:acme"})) == ["acme-2", "acme-1"]
    assert ids(api.get(runs_url(), {"tag": "concurrency:tenant:acme", "status": "pending"})) == ["acme-1"]


def test_filters_with_a_nul_character_are_400_not_500(api: APIClient) -> None:
    assert api.get(f"{runs_url()}?workflow=a%00b").status_code == 400
    assert api.get(f"{runs_url()}?tag=a%00b").status_code == 400


def _runs_with_tags_and_steps(n: int) -> None:
    parent = WorkflowRunFactory(run_id="parent")
    for i in range(n):
        run = WorkflowRunFactory(parent=parent)
        tagged(run, f"concurrency:k{i}", "extra")
        StepRecordFactory(run=run, position=0)
        StepRecordFactory(run=run, position=1)


@pytest.mark.parametrize("n", [2, 9])
def test_list_query_count_does_not_grow_with_the_page(api: APIClient, django_assert_num_queries: Any, n: int) -> None:
    _runs_with_tags_and_steps(n)
    # The page of runs (parent joined), tags, steps: no COUNT(*) (cursor pagination).
    with django_assert_num_queries(3):
        response = api.get(runs_url())
    results = response.json()["results"]
    assert len(results) == n + 1
    child = next(run for run in results if run["parent_run_id"] == "parent")
    assert len(child["tags"]) == 2 and len(child["steps"]) == 2


def test_detail_reads_the_run_its_tags_and_steps_in_three_queries(api: APIClient, django_assert_num_queries: Any) -> None:
    run = WorkflowRunFactory(run_id="r1")
    tagged(run, "a", "b")
    StepRecordFactory(run=run, position=0)
    with django_assert_num_queries(3):
        response = api.get(run_url("r1"))
    assert response.json()["tags"] == ["a", "b"]


def test_options_describes_the_start_body(api: APIClient) -> None:
    response = api.options(runs_url())
    assert response.status_code == 200
    assert {"workflow", "input", "run_id"} <= set(response.json()["actions"]["POST"])


def test_detail_shows_the_run_with_tags_and_steps(api: APIClient) -> None:
    now = timezone.now()
    run = WorkflowRunFactory(
        run_id="r1",
        workflow="test.add",
        status="failed",
        input={"a": 1},
        error={"type": "x.Boom", "message": "boom"},
        attempt=2,
        started_at=now,
        finished_at=now,
    )
    tagged(run, "concurrency:k", "b-tag")
    StepRecordFactory(run=run, position=1, name="second", outcome="failed", attempts=3)
    StepRecordFactory(run=run, position=0, name="first", output={"secret": "not in the API"})
    response = api.get(run_url("r1"))
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {
        "run_id",
        "workflow",
        "version",
        "namespace",
        "status",
        "input",
        "output",
        "error",
        "attempt",
        "parent_run_id",
        "queue",
        "waiting_for",
        "wake_at",
        "created_at",
        "updated_at",
        "started_at",
        "finished_at",
        "tags",
        "steps",
    }
    assert (body["run_id"], body["workflow"], body["status"], body["attempt"]) == ("r1", "test.add", "failed", 2)
    assert body["error"] == {"type": "x.Boom", "message": "boom"}
    assert body["input"] == {"a": 1}
    assert body["tags"] == ["b-tag", "concurrency:k"]
    assert [(s["position"], s["name"], s["outcome"], s["attempts"]) for s in body["steps"]] == [
        (0, "first", "completed", 1),
        (1, "second", "failed", 3),
    ]
    assert set(body["steps"][0]) == {"position", "name", "outcome", "attempts", "finished_at"}
    assert body["started_at"] is not None and body["finished_at"] is not None


def test_detail_of_a_run_id_with_a_slash(api: APIClient) -> None:
    WorkflowRunFactory(run_id="orders/42")
    assert api.get(run_url("orders/42")).json()["run_id"] == "orders/42"


@pytest.mark.parametrize("path", ["runs/nope/", "runs/a%00b/", "runs/" + "x" * 300 + "/"])
def test_detail_of_an_unknown_run_is_404(api: APIClient, path: str) -> None:
    response = api.get(f"/durable/{path}")
    assert response.status_code == 404
    assert response.json()["code"] == "run_not_found"


def test_cancel_cancels_and_frees_the_slot(api: APIClient) -> None:
    started = [start_add(api, "c") for _ in range(3)]
    run_id = started[0].json()["run_id"]
    response = api.post(cancel_url(run_id))
    assert response.status_code == 200
    assert response.json()["run_id"] == run_id
    assert response.json()["status"] == "cancelled"
    assert response.json()["finished_at"] is not None
    assert models.WorkflowRun.objects.get(run_id=run_id).status == "cancelled"
    assert set(models.RunTag.objects.filter(run__run_id=run_id).values_list("status", flat=True)) == {"cancelled"}
    assert engine.count_runs(tag="concurrency:c", statuses=["pending"]) == 2


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled", "dead"])
def test_cancel_of_a_finished_run_is_409(api: APIClient, status: str) -> None:
    WorkflowRunFactory(run_id="done", status=status)
    response = api.post(cancel_url("done"))
    assert response.status_code == 409
    assert response.json()["code"] == "run_terminal"
    assert status in response.json()["detail"]
    assert models.WorkflowRun.objects.get(run_id="done").status == status


@pytest.mark.parametrize("run_id", ["nope", "a\x00b"])
def test_cancel_of_an_unknown_run_is_404(api: APIClient, run_id: str) -> None:
    response = api.post(cancel_url(run_id))
    assert response.status_code == 404
    assert response.json()["code"] == "run_not_found"


def test_cancel_route_wins_over_a_run_id_ending_in_cancel(api: APIClient) -> None:
    WorkflowRunFactory(run_id="r1")
    assert api.get(cancel_url("r1")).status_code == 405
    assert models.WorkflowRun.objects.get(run_id="r1").status == "pending"


def test_unknown_method_is_405(api: APIClient) -> None:
    assert api.delete(runs_url()).status_code == 405
    assert api.put(run_url("r1"), {}, format="json").status_code == 405


def test_browsable_api_renders(api: APIClient) -> None:
    WorkflowRunFactory(run_id="r1")
    response = api.get(runs_url(), HTTP_ACCEPT="text/html")
    assert response.status_code == 200
    assert b"r1" in response.content
    assert api.get(run_url("r1"), HTTP_ACCEPT="text/html").status_code == 200


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_run_started_over_http_executes_and_its_steps_show(api: APIClient, celery_worker: Any) -> None:
    response = api.post(runs_url(), {"workflow": "test.add", "input": add_input("e2e", 2, 3)}, format="json")
    assert response.status_code == 201
    run_id = response.json()["run_id"]
    body = wait_for(
        lambda: (r := api.get(run_url(run_id)).json())["status"] == "completed" and r,
        what="the run to complete",
    )
    assert body["output"] == {"total": 5}
    assert [(s["position"], s["name"], s["outcome"]) for s in body["steps"]] == [(0, "add", "completed")]
    assert body["attempt"] == 1
    assert api.post(cancel_url(run_id)).status_code == 409


# -- the list's cost does not grow with the number of runs -----------------------------


def _finished_history(n: int, running: int) -> None:
    """``running`` running runs of ``test.add``, then completed runs of ``test.other`` up to ``n``
    in all (newer), then ANALYZE (the planner's statistics)."""
    from django.db import connection

    at = timezone.now()
    models.WorkflowRun.objects.bulk_create(
        (
            models.WorkflowRun(
                run_id=f"h{i}",
                workflow="test.add" if i < running else "test.other",
                version="1",
                status="running" if i < running else "completed",
                created_at=at + timedelta(milliseconds=i),
            )
            for i in range(n)
        ),
        batch_size=1000,  # a statement binds at most 65,535 parameters (Django's server_side_binding)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE durable_workflowrun")


def _plan_of_runs_page(api: APIClient, query: dict[str, str], url: str = "") -> str:
    """The plan of the statement that reads the page of runs (the endpoint's first query)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        assert api.get(url or runs_url(), query).status_code == 200
    page_sql = captured.captured_queries[0]["sql"]
    assert 'FROM "durable_workflowrun"' in page_sql and "COUNT(" not in page_sql
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (COSTS OFF) " + page_sql)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("query", "index"),
    [
        ({}, "durable_run_created_idx"),
        ({"status": "running"}, "durable_run_status_idx"),
        # Nearly every run matches: reading newest first and skipping the few others
        # is as good as the status index; either is an index range in list order.
        ({"status": "completed"}, "durable_run_"),
        ({"workflow": "test.add"}, "durable_run_workflow_idx"),
    ],
)
def test_list_reads_a_page_through_an_index_in_its_order(api: APIClient, query: dict[str, str], index: str) -> None:
    _finished_history(4000, running=20)
    plan = _plan_of_runs_page(api, query)
    # An index read newest first, stopped after a page: no sort of every matching row.
    assert f"Index Scan using {index}" in plan, plan  # not Index Scan Backward: the index is newest first
    assert "Sort" not in plan and "Seq Scan" not in plan, plan


@pytest.mark.postgres
@pytest.mark.parametrize("query", [{}, {"status": "completed"}])
def test_a_later_page_starts_in_the_index_at_its_cursor(api: APIClient, query: dict[str, str]) -> None:
    _finished_history(4000, running=20)
    first = api.get(runs_url(), query).json()
    plan = _plan_of_runs_page(api, {}, url=first["next"])
    # The cursor's time is read once (by primary key) and bounds the index range:
    # no page before it is read again, however deep the page.
    runs_scan = plan[plan.index("Index Scan using durable_run_") :]
    assert "created_at <= COALESCE($0" in runs_scan.splitlines()[1], plan  # the scan's Index Cond
    assert "Sort" not in plan and "Seq Scan" not in plan, plan
    second = api.get(first["next"]).json()["results"]
    assert second[0]["run_id"] == f"h{4000 - 51}"


@pytest.mark.postgres
@pytest.mark.parametrize("n", [100, 3000])
def test_list_sends_the_same_statements_whatever_the_number_of_runs(
    api: APIClient, django_assert_num_queries: Any, n: int
) -> None:
    _finished_history(n, running=5)
    # The page of runs (parent joined), tags, steps: nothing counts the runs.
    with django_assert_num_queries(3):
        response = api.get(runs_url(), {"status": "running"})
    assert [run["run_id"] for run in response.json()["results"]] == [f"h{i}" for i in reversed(range(5))]
