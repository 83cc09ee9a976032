"""POST runs/: starting a run through the engine, under its quota."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from durable import models
from durable.testing import WorkflowRunFactory
from tests.api.helpers import add_input, counts, runs_url, start_add

pytestmark = pytest.mark.django_db


def post_raw(api: APIClient, body: str | bytes, content_type: str = "application/json") -> Any:
    return api.post(runs_url(), data=body, content_type=content_type)


def test_start_creates_a_pending_run(api: APIClient) -> None:
    response = start_add(api, "k")
    assert response.status_code == 201, response.data
    body = response.json()
    run = models.WorkflowRun.objects.get(run_id=body["run_id"])
    assert (run.workflow, run.status, run.input) == ("test.add", "pending", {"a": 1, "b": 2, "key": "k"})
    assert body["workflow"] == "test.add"
    assert body["version"] == "1"
    assert body["namespace"] == "default"
    assert body["status"] == "pending"
    assert body["input"] == {"a": 1, "b": 2, "key": "k"}
    assert body["tags"] == ["concurrency:k"]
    assert body["steps"] == []
    assert body["output"] is None and body["error"] is None
    assert body["created_at"] is not None


def test_start_with_explicit_run_id_is_idempotent(api: APIClient) -> None:
    data = {"workflow": "test.add", "input": add_input("k"), "run_id": "order-42"}
    first = api.post(runs_url(), data, format="json")
    assert first.status_code == 201
    before = counts()
    again = api.post(runs_url(), data, format="json")
    assert again.status_code == 200
    assert again.json()["run_id"] == "order-42"
    assert again.json()["created_at"] == first.json()["created_at"]
    assert counts() == before


def test_restart_of_existing_run_id_is_not_rejected_by_a_full_quota(api: APIClient) -> None:
    for i in range(3):
        data = {"workflow": "test.add", "input": add_input("full"), "run_id": f"r{i}"}
        assert api.post(runs_url(), data, format="json").status_code == 201
    again = start_add(api, "full", run_id="r0")
    assert again.status_code == 200
    assert again.json()["run_id"] == "r0"


def test_run_id_of_another_workflow_is_a_conflict(api: APIClient) -> None:
    WorkflowRunFactory(run_id="taken", workflow="test.fatal")
    response = start_add(api, run_id="taken")
    assert response.status_code == 409
    assert response.json()["code"] == "run_id_taken"
    assert "input" not in response.json()


def test_start_over_quota_is_429_with_retry_after_and_creates_nothing(api: APIClient, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "RETRY_AFTER": 7}
    for _ in range(3):
        assert start_add(api, "acme").status_code == 201
    before = counts()
    response = start_add(api, "acme", run_id="x")
    assert response.status_code == 429
    assert response["Retry-After"] == "7"
    body = response.json()
    assert body["code"] == "concurrency_limit"
    assert (body["workflow"], body["key"], body["limit"], body["active"]) == ("test.add", "acme", 3, 3)
    assert "acme" in body["detail"]
    assert counts() == before
    assert not models.WorkflowRun.objects.filter(run_id="x").exists()


def test_a_finished_run_frees_its_slot(api: APIClient) -> None:
    ids = [start_add(api, "free").json()["run_id"] for _ in range(3)]
    assert start_add(api, "free").status_code == 429
    assert api.post(f"{runs_url()}{ids[0]}/cancel/").status_code == 200
    assert start_add(api, "free").status_code == 201


@pytest.mark.parametrize(("setting", "header"), [(0, "1"), (-5, "1"), (2.2, "3"), ("junk", "1"), (30, "30")])
def test_retry_after_is_whole_seconds_at_least_one(api: APIClient, settings: Any, setting: Any, header: str) -> None:
    settings.DURABLE = {**settings.DURABLE, "RETRY_AFTER": setting}
    for _ in range(3):
        start_add(api, "ra")
    response = start_add(api, "ra")
    assert response.status_code == 429
    assert response["Retry-After"] == header


def test_unknown_workflow_is_404_and_creates_nothing(api: APIClient) -> None:
    before = counts()
    response = api.post(runs_url(), {"workflow": "no.such", "input": {}}, format="json")
    assert response.status_code == 404
    assert response.json()["code"] == "unknown_workflow"
    assert "no.such" in response.json()["detail"]
    assert counts() == before


def test_input_the_quota_key_cannot_be_computed_from_is_400(api: APIClient) -> None:
    # test.add's key function calls input.get(...): a list input makes it raise.
    before = counts()
    response = api.post(runs_url(), {"workflow": "test.add", "input": [1, 2]}, format="json")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_start"
    assert "concurrency key" in response.json()["detail"]
    assert counts() == before


@pytest.mark.parametrize(
    "body",
    [
        '{"workflow": "test.add", "input": {"a": 1,}}',
        '{"workflow": "test.add", "input": ',
        "not json at all",
        '{"workflow": "test.add", "input": {"a": NaN}}',
        '{"workflow": "test.add", "input": {"a": Infinity}}',
        '{"workflow": "test.add", "input": [-Infinity]}',
        "\udcff",
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["trailing-comma", "truncated", "garbage", "nan", "infinity", "minus-infinity", "undecodable", "deep"],
)
def test_malformed_json_is_400(api: APIClient, body: str) -> None:
    before = counts()
    response = post_raw(api, body.encode("utf-8", "surrogateescape") if "\udcff" in body else body)
    assert response.status_code == 400
    assert response.json()["code"] == "parse_error"
    assert counts() == before


@pytest.mark.parametrize("body", ["[]", "[1, 2]", '"test.add"', "42", "true", "null"])
def test_a_body_that_is_not_a_json_object_is_400(api: APIClient, body: str) -> None:
    before = counts()
    response = post_raw(api, body)
    assert response.status_code == 400
    assert counts() == before


def test_form_encoded_body_is_refused(api: APIClient) -> None:
    response = api.post(runs_url(), {"workflow": "test.add", "input": "x"})  # multipart
    assert response.status_code == 415
    assert models.WorkflowRun.objects.count() == 0


def test_empty_body_is_400_naming_the_missing_fields(api: APIClient) -> None:
    response = post_raw(api, "")
    assert response.status_code == 400
    assert set(response.json()) == {"workflow", "input"}


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"input": {}}, "workflow"),
        ({"workflow": "test.add"}, "input"),
        ({"workflow": 5, "input": {}}, "workflow"),
        ({"workflow": None, "input": {}}, "workflow"),
        ({"workflow": "", "input": {}}, "workflow"),
        ({"workflow": ["test.add"], "input": {}}, "workflow"),
        ({"workflow": "w" * 256, "input": {}}, "workflow"),
        ({"workflow": "test.add\x00", "input": {}}, "workflow"),
        ({"workflow": "test.add", "input": {}, "run_id": 123}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": 1.5}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": True}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": ["a"]}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": {"id": "a"}}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": ""}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": "r" * 256}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": "a\x00b"}, "run_id"),
        ({"workflow": "test.add", "input": {}, "run_id": "\ud800"}, "run_id"),
        ({"workflow": "test.add", "input": {"s": "a\x00b"}}, "input"),
        ({"workflow": "test.add", "input": {"a\x00": 1}}, "input"),
        ({"workflow": "test.add", "input": ["\udfff"]}, "input"),
        ({"workflow": "test.add", "input": {"k": "k"}, "inputs": {}}, "inputs"),
    ],
)
def test_invalid_fields_are_400_and_create_nothing(api: APIClient, data: dict[str, Any], field: str) -> None:
    before = counts()
    response = post_raw(api, json.dumps(data))  # ASCII-escaped: lone surrogates travel as \udxxx
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert counts() == before


def test_input_nested_beyond_the_limit_is_400(api: APIClient) -> None:
    from durable.api.serializers import MAX_INPUT_DEPTH

    def nested(depth: int) -> Any:
        value: Any = 0
        for _ in range(depth):
            value = [value]
        return value

    ok = api.post(runs_url(), {"workflow": "test.add", "input": {"a": nested(MAX_INPUT_DEPTH - 1)}}, format="json")
    assert ok.status_code == 201, ok.content
    too_deep = api.post(runs_url(), {"workflow": "test.add", "input": {"a": nested(MAX_INPUT_DEPTH)}}, format="json")
    assert too_deep.status_code == 400
    assert "input" in too_deep.json()


@pytest.mark.parametrize(
    "value",
    [None, 0, -1.5, "text", True, [], {}, [None, {"x": [1, "y"]}], "ünïcødé ✓", "NaN", {"Infinity": "-Infinity"}],
)
def test_any_json_value_is_a_valid_input(api: APIClient, value: Any) -> None:
    response = api.post(runs_url(), {"workflow": "test.fatal", "input": value}, format="json")
    assert response.status_code == 201, response.content
    assert models.WorkflowRun.objects.get(run_id=response.json()["run_id"]).input == value


def test_null_run_id_means_a_generated_one(api: APIClient) -> None:
    response = api.post(runs_url(), {"workflow": "test.fatal", "input": None, "run_id": None}, format="json")
    assert response.status_code == 201
    assert len(response.json()["run_id"]) == 32


def test_group_round_robin_queues_then_answers_429_when_the_queue_is_full(api: APIClient) -> None:
    first = api.post(runs_url(), {"workflow": "api.queued", "input": {"key": "q"}}, format="json")
    assert (first.status_code, first.json()["status"]) == (201, "pending")
    second = api.post(runs_url(), {"workflow": "api.queued", "input": {"key": "q"}}, format="json")
    assert (second.status_code, second.json()["status"]) == (201, "queued")
    before = counts()
    third = api.post(runs_url(), {"workflow": "api.queued", "input": {"key": "q"}}, format="json")
    assert third.status_code == 429
    assert third["Retry-After"] == "1"
    body = third.json()
    assert body["code"] == "concurrency_queue_full"
    assert (body["key"], body["limit"], body["active"], body["queued"], body["max_queued"]) == ("q", 1, 1, 1, 1)
    assert counts() == before
    quota = api.get("/durable/quotas/q/").json()
    assert (quota["active"], quota["queued"]) == (1, 1)


@pytest.mark.parametrize("run_id", ["x/cancel", "y/signal", "t\nnl", " padded ", ".."])
def test_run_id_the_urls_cannot_address_is_400_and_creates_nothing(api: APIClient, run_id: str) -> None:
    before = counts()
    response = start_add(api, run_id=run_id)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_start"
    assert "run id" in response.json()["detail"]
    assert counts() == before


def test_every_url_of_an_accepted_run_id_reaches_the_run(api: APIClient) -> None:
    from tests.api.helpers import cancel_url, run_url, signal_url

    run_id = "a b:ü?#%.x"
    assert start_add(api, run_id=run_id).status_code == 201
    assert api.get(run_url(run_id)).json()["run_id"] == run_id
    assert api.post(signal_url(run_id), {"name": "go"}, format="json").status_code == 202
    assert api.post(cancel_url(run_id)).json()["status"] == "cancelled"


def test_a_stored_run_id_with_a_slash_is_still_reachable(api: APIClient) -> None:
    """Runs created before the run id rule are not affected by it."""
    from tests.api.helpers import cancel_url

    WorkflowRunFactory(run_id="legacy/7", workflow="test.add", status="pending")
    assert start_add(api, run_id="legacy/7").status_code == 200
    assert api.post(cancel_url("legacy/7")).json()["status"] == "cancelled"
