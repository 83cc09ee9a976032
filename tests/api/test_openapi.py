"""The OpenAPI schema (drf-spectacular, the ``openapi`` extra): valid, without a single
generator warning, with each operation's real status codes; and a bounded
property-based fuzz run (schemathesis) over every operation that finds no 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from drf_spectacular.drainage import GENERATOR_STATS
from drf_spectacular.validation import validate_schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

SCHEMA_URL = "/durable/schema/?format=json"

#: operationId -> the status codes it documents (401 and 403 on every one).
EXPECTED = {
    "listRuns": {200, 400, 404},
    "startRun": {200, 201, 400, 404, 409, 415, 422, 429},
    "getRun": {200, 404},
    "cancelRun": {200, 404, 409},
    "signalRun": {202, 400, 404, 409, 415},
    "listQuotas": {200, 404},
    "getQuota": {200, 404},
    "setQuotaLimit": {200, 400, 415},
    "listSchedules": {200, 404},
    "createSchedule": {201, 400, 415},
    "getSchedule": {200, 404},
    "pauseSchedule": {200, 404},
    "resumeSchedule": {200, 404},
}


@pytest.fixture
def schema(api: APIClient) -> dict[str, Any]:
    GENERATOR_STATS.reset()
    response = api.get(SCHEMA_URL)
    assert response.status_code == 200
    return dict(response.json())


@pytest.mark.django_db
def test_the_schema_is_valid_openapi_without_generator_warnings(schema: dict[str, Any]) -> None:
    validate_schema(schema)
    assert not GENERATOR_STATS, (GENERATOR_STATS._warn_cache, GENERATOR_STATS._error_cache)
    operations = {op["operationId"]: op for ops in schema["paths"].values() for op in ops.values()}
    assert {name: {int(code) for code in op["responses"]} - {401, 403} for name, op in operations.items()} == EXPECTED
    assert all({"401", "403"} <= set(op["responses"]) for op in operations.values())
    # Only durable's endpoints, at the paths the URLconf mounts them on.
    assert sorted(schema["paths"])[0] == "/durable/quotas/" and "/durable/schema/" not in schema["paths"]


@pytest.mark.django_db
def test_the_429_has_its_retry_after_header_and_the_limits_fields(schema: dict[str, Any]) -> None:
    refused = schema["paths"]["/durable/runs/"]["post"]["responses"]["429"]
    assert refused["headers"]["Retry-After"]["schema"] == {"type": "integer"}
    body = schema["components"]["schemas"]["ConcurrencyLimitError"]
    assert {"detail", "code", "workflow", "key", "limit", "active", "retry_after"} <= set(body["required"])
    header = [p for p in schema["paths"]["/durable/runs/"]["post"]["parameters"] if p["in"] == "header"]
    assert [p["name"] for p in header] == ["Idempotency-Key"]


@pytest.mark.django_db
def test_lists_are_typed_as_pages_of_items(schema: dict[str, Any]) -> None:
    for path, item in [("/durable/runs/", "Run"), ("/durable/quotas/", "Quota"), ("/durable/schedules/", "Schedule")]:
        page = schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert page == f"#/components/schemas/Paginated{item}List"
        results = schema["components"]["schemas"][f"Paginated{item}List"]["properties"]["results"]
        assert results == {"type": "array", "items": {"$ref": f"#/components/schemas/{item}"}}


@pytest.mark.django_db
def test_the_schema_needs_authentication_as_the_api_does(anon: APIClient) -> None:
    assert anon.get(SCHEMA_URL).status_code in (401, 403)


@pytest.fixture
def token(user: Any) -> str:
    user.is_staff = True  # PUT quotas/<key>/limit/ is for staff: fuzz it past the permission check
    user.save(update_fields=["is_staff"])
    return str(Token.objects.create(user=user).key)


@pytest.fixture
def fuzzed_api(db: None, token: str) -> Iterator[Any]:
    # As Django's test client does: a request must not close the test's connection
    # (its transaction holds what the test made).
    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    try:
        yield schemathesis.openapi.from_wsgi(SCHEMA_URL, get_wsgi_application(), headers={"Authorization": f"Token {token}"})
    finally:
        for signal in (request_started, request_finished):
            signal.connect(close_old_connections)


#: Cases per operation: 13 operations, 325 cases.
CASES_PER_OPERATION = 25


def test_no_request_the_schema_allows_makes_a_server_error(fuzzed_api: Any, token: str) -> None:
    operations = [result.ok() for result in fuzzed_api.get_all_operations()]
    assert len(operations) == len(EXPECTED)
    calls: list[int] = []

    @settings(
        max_examples=CASES_PER_OPERATION,
        deadline=None,
        derandomize=True,  # the same cases on every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def call(operation: Any, data: st.DataObject) -> None:
        case = data.draw(operation.as_strategy())
        response = case.call(headers={"Authorization": f"Token {token}"})
        calls.append(response.status_code)
        assert response.status_code < 500, (case.method, case.formatted_path, case.query, case.body, response.text[:500])

    for operation in operations:
        call(operation)
    assert len(calls) >= len(EXPECTED) * CASES_PER_OPERATION // 2  # the cases really ran
