"""The quota dashboard: use bars, FULL marks, queued ages, fullest first, filters, a key's runs."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from durable import models
from durable.admin import ConcurrencyQuotaAdmin
from durable.status import RunStatus
from durable.testing import WorkflowRunFactory, tagged
from tests.admin.helpers import QUOTAS_URL, key_with, listed, quota_url, row

pytestmark = pytest.mark.django_db

R, Q, C = RunStatus.RUNNING, RunStatus.QUEUED, RunStatus.COMPLETED


@pytest.fixture
def keys() -> None:
    """acme full (8 of 8), globex half full with 2 queued, hooli 1 of 3, two idle keys."""
    key_with("tenant:acme", 8, *[R] * 8, minutes_ago=40)
    key_with("tenant:globex", 4, R, R, minutes_ago=25)
    key_with("tenant:globex", 4, Q, Q, minutes_ago=12)
    key_with("tenant:hooli", 3, R)
    key_with("tenant:aaa-idle", 5, C, C)
    key_with("tenant:zzz-idle", 5)


def test_each_key_shows_use_with_a_bar_full_mark_and_queued_age(admin_client: Client, keys: None) -> None:
    content = admin_client.get(QUOTAS_URL).content.decode()
    acme = row(content, "tenant:acme")
    assert '<span class="durable-use-count">8 / 8</span>' in acme and "FULL" in acme and "width:100%" in acme
    assert re.search(r">40m( [0-2]s)? ago<", acme)  # oldest in flight, as an age
    globex = row(content, "tenant:globex")
    assert '<span class="durable-use-count">2 / 4</span>' in globex and "FULL" not in globex
    assert '<span class="durable-queued">2</span>' in globex
    assert re.search(r">waiting 12m( [0-2]s)?<", globex)
    idle = row(content, "tenant:zzz-idle")
    assert '<span class="durable-use-count">0 / 5</span>' in idle and "FULL" not in idle
    assert '<td class="field-oldest_queued">—</td>' in idle


def test_fullest_first_by_default_then_idle_keys_by_name(admin_client: Client, keys: None) -> None:
    response = admin_client.get(QUOTAS_URL)
    assert listed(response) == ["tenant:acme", "tenant:globex", "tenant:hooli", "tenant:aaa-idle", "tenant:zzz-idle"]
    # The header marks the use column as the sorted one, descending.
    assert 'class="sortable column-use sorted descending"' in response.content.decode()


def test_sorting_by_use_ascending_and_by_key(admin_client: Client, keys: None) -> None:
    use_column = ConcurrencyQuotaAdmin.list_display.index("use")
    ascending = listed(admin_client.get(QUOTAS_URL, {"o": str(use_column)}))
    assert ascending == ["tenant:aaa-idle", "tenant:zzz-idle", "tenant:hooli", "tenant:globex", "tenant:acme"]
    descending = listed(admin_client.get(QUOTAS_URL, {"o": f"-{use_column}"}))
    assert descending == ["tenant:acme", "tenant:globex", "tenant:hooli", "tenant:aaa-idle", "tenant:zzz-idle"]
    by_key = listed(admin_client.get(QUOTAS_URL, {"o": "0"}))
    assert by_key == sorted(by_key)


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_pages_by_use_cross_from_busy_to_idle_keys(
    admin_client: Client, keys: None, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    monkeypatch.setattr(ConcurrencyQuotaAdmin, "list_per_page", 2)
    use_column = ConcurrencyQuotaAdmin.list_display.index("use")
    query = {"o": str(use_column) if order == "asc" else f"-{use_column}"}
    pages = [listed(admin_client.get(QUOTAS_URL, {**query, "p": str(p)})) for p in (1, 2, 3)]
    everything = listed(admin_client.get(QUOTAS_URL, {**query, "all": ""}))
    assert [key for page in pages for key in page] == everything
    assert len(everything) == 5
    past_the_end = admin_client.get(QUOTAS_URL, {**query, "p": "4"})
    assert past_the_end.status_code == 302 and past_the_end["Location"].endswith("?e=1")  # as Django's own lists
    expected_first = "tenant:acme" if order == "desc" else "tenant:aaa-idle"
    assert pages[0][0] == expected_first


def test_filters_full_queued_and_strategy(admin_client: Client, keys: None) -> None:
    key_with("tenant:closed", 0)  # a limit of 0 refuses every start: full with nothing in flight
    key_with("tenant:rr", 1, R, Q, workflow="test.slot_holder")  # a GROUP_ROUND_ROBIN workflow
    assert listed(admin_client.get(QUOTAS_URL, {"use": "full"})) == ["tenant:acme", "tenant:rr", "tenant:closed"]
    assert listed(admin_client.get(QUOTAS_URL, {"use": "queued"})) == ["tenant:rr", "tenant:globex"]
    assert listed(admin_client.get(QUOTAS_URL, {"strategy": "group_round_robin"})) == ["tenant:rr"]
    reject = listed(admin_client.get(QUOTAS_URL, {"strategy": "reject"}))
    assert reject == ["tenant:acme", "tenant:globex", "tenant:hooli"]  # test.add's quota rejects
    # Filter and search together.
    assert listed(admin_client.get(QUOTAS_URL, {"use": "full", "q": "acme"})) == ["tenant:acme"]


def test_a_page_costs_the_same_with_many_more_idle_keys(admin_client: Client, keys: None) -> None:
    def page_queries() -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(QUOTAS_URL)
        assert response.status_code == 200
        return [q["sql"] for q in captured.captured_queries]

    page_queries()  # warm the session and content-type caches
    few = page_queries()
    models.ConcurrencyLock.objects.bulk_create(models.ConcurrencyLock(key=f"tenant:idle-{i:04d}", limit=5) for i in range(300))
    many = page_queries()
    assert len(many) == len(few)
    # The in-flight keys are read from the runs in flight (one grouped query), not per key.
    grouped = [sql for sql in many if "GROUP BY" in sql and "durable_runtag" in sql]
    assert len(grouped) == 2  # the keys in use, and the page's counts
    assert not any("tenant:idle-0299" in sql for sql in many)  # an idle key off the page is never named


def test_detail_page_lists_the_runs_in_flight_and_queued_with_ages(admin_client: Client, keys: None) -> None:
    response = admin_client.get(quota_url("tenant:globex"))
    assert response.status_code == 200
    content = response.content.decode()
    assert '<span class="durable-use-count">2 / 4</span>' in content
    in_flight = content[content.index("field-runs_in_flight") : content.index("field-runs_queued")]
    assert in_flight.count("durable-status-running") == 2
    assert re.search(r">25m( [0-2]s)?<", in_flight)
    queued = content[content.index("field-runs_queued") :]
    assert queued.count("durable-status-queued") == 2
    assert "None" not in content.replace("NoneType", "")
    assert "+00:00" not in content  # no raw datetimes
    idle = admin_client.get(quota_url("tenant:zzz-idle")).content.decode()
    assert "No run in flight." in idle and "No run queued." in idle and "Oldest queued" not in idle
    assert "None" not in idle.replace("NoneType", "")  # nothing queued, nothing in flight: "—", not "None"


def test_detail_page_lists_at_most_a_page_of_runs(admin_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    from durable.admin import quotas

    monkeypatch.setattr(quotas, "RUNS_SHOWN", 3)
    key_with("tenant:big", 10, *[R] * 5)
    content = admin_client.get(quota_url("tenant:big")).content.decode()
    assert content.count("durable-status-running") == 3
    assert "and 2 more" in content and "?tag=concurrency%3Atenant%3Abig" in content


def test_a_lifetime_cap_lists_its_unfinished_runs_only(admin_client: Client) -> None:
    models.ConcurrencyLock.objects.create(key="tenant:cap", limit=3, count_statuses=["running", "completed"])
    for status in (R, C, C):
        tagged(WorkflowRunFactory(status=status, created_at=timezone.now() - timedelta(minutes=1)), "concurrency:tenant:cap")
    content = admin_client.get(quota_url("tenant:cap")).content.decode()
    assert '<span class="durable-use-count">3 / 3</span>' in content and "FULL" in content
    assert content.count("durable-status-running") == 1 and "durable-status-completed" not in content
    assert "more:" not in content


def test_quota_pages_stay_read_only(admin_client: Client, keys: Any) -> None:
    response = admin_client.get(quota_url("tenant:acme"))
    assert b'name="_save"' not in response.content
    assert b"Show counts" not in admin_client.get(QUOTAS_URL).content  # no facet counts over every key


@pytest.fixture
def bound_on_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL, the default connection binds parameters on the server (as a project with
    OPTIONS server_side_binding does), where a statement takes at most 65,535 parameters."""
    if connection.vendor == "postgresql":
        connection.close()
        options = {**connection.settings_dict.get("OPTIONS", {}), "server_side_binding": True}
        monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)


@pytest.mark.django_db(transaction=True)
def test_a_filter_of_more_keys_in_flight_than_a_statement_binds(bound_on_the_server: None) -> None:
    """The filters select among the keys in flight, which may be more than a statement's
    parameters (65,535 bound on PostgreSQL's server; SQLite's limit is set when it is built,
    32,766 by default): one parameter holds them, however many."""
    from durable.admin import usage

    # Two keys with lock rows and 70,000 without (the filters select among the keys in
    # flight; only keys with a lock row are listed), each with a run queued, of a
    # GROUP_ROUND_ROBIN workflow; then no key at all.
    key_with("tenant:a", 1, R, Q, workflow="test.slot_holder")
    key_with("tenant:b", 1, R, Q, workflow="test.slot_holder")
    in_flight = {f"tenant:k{i:05d}": usage.InFlight({R: 1, Q: 1}, {("test.slot_holder", "1")}) for i in range(70_000)}
    in_flight.update(usage.in_flight())
    for test in ("queued", "group_round_robin", "full"):
        matching = models.ConcurrencyLock.objects.filter(usage.keys_where(in_flight, test)).order_by("key")
        assert list(matching.values_list("key", flat=True)) == ["tenant:a", "tenant:b"], test
        assert not models.ConcurrencyLock.objects.filter(usage.keys_where({}, test)).exists(), test
    connection.close()  # the next test connects with the options put back
