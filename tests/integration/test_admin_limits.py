"""The limit changes admin: setting and clearing a key's override, the audit trail."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

import durable
from durable import Concurrency, ConcurrencyLimitError
from durable.models import ConcurrencyLock, LimitChange

pytestmark = pytest.mark.django_db

ADD_URL = reverse("admin:durable_limitchange_add")
LIST_URL = reverse("admin:durable_limitchange_changelist")


def _start(key: str) -> Any:
    return durable.engine.start("test.add", {"a": 1, "b": 2}, concurrency=Concurrency(key=key, limit=3))


def test_the_add_form_sets_the_override_with_the_operator_and_reason(admin_client: Client, admin_user: Any) -> None:
    _start("acme")
    response = admin_client.post(ADD_URL, {"key": "acme", "limit": "1", "reason": "incident 42"})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert ConcurrencyLock.objects.get(key="acme").limit_override == 1
    change = LimitChange.objects.get()
    assert (change.old_limit, change.new_limit, change.reason, change.changed_by, change.changed_by_name) == (
        3,
        1,
        "incident 42",
        admin_user,
        admin_user.get_username(),
    )
    with pytest.raises(ConcurrencyLimitError):
        _start("acme")


def test_a_blank_limit_clears_the_override(admin_client: Client) -> None:
    durable.engine.set_limit_override("acme", 0, "blocked")
    assert admin_client.post(ADD_URL, {"key": "acme", "limit": "", "reason": "unblocked"}).status_code == 302
    assert ConcurrencyLock.objects.get(key="acme").limit_override is None
    _start("acme")


@pytest.mark.parametrize(
    "data",
    [
        {"key": "acme", "limit": "1", "reason": ""},
        {"key": "", "limit": "1", "reason": "r"},
        {"key": "a", "limit": "x", "reason": "r"},
    ],
)
def test_a_bad_form_changes_nothing(admin_client: Client, data: dict[str, str]) -> None:
    response = admin_client.post(ADD_URL, data)
    assert response.status_code == 200 and b"errornote" in response.content
    assert not LimitChange.objects.exists() and not ConcurrencyLock.objects.exists()


def test_the_list_filters_by_key_and_changes_are_read_only(admin_client: Client) -> None:
    durable.engine.set_limit_override("acme", 2, "one")
    durable.engine.set_limit_override("globex", 5, "two")
    content = admin_client.get(LIST_URL, {"key": "acme"}).content.decode()
    assert "one" in content and "two" not in content
    change = LimitChange.objects.get(key="acme")
    page = admin_client.get(reverse("admin:durable_limitchange_change", args=[change.pk]))
    assert page.status_code == 200 and b'name="reason"' not in page.content
    assert admin_client.post(reverse("admin:durable_limitchange_delete", args=[change.pk]), {"post": "yes"}).status_code == 403
    assert LimitChange.objects.count() == 2


def test_the_add_form_prefills_the_key_from_the_query(admin_client: Client) -> None:
    assert b'value="tenant:acme"' in admin_client.get(ADD_URL, {"key": "tenant:acme"}).content


def test_the_quota_pages_show_the_override_and_who_changed_it(admin_client: Client, admin_user: Any) -> None:
    from django.contrib.admin.utils import quote

    for _ in range(2):
        _start("acme")
    admin_client.post(ADD_URL, {"key": "acme", "limit": "2", "reason": "incident 42"})

    # The list measures use against the override (2 of 2: full), and marks it.
    page = admin_client.get(reverse("admin:durable_concurrencylock_changelist")).content.decode()
    row = page[page.index(">acme</a>") :]
    row = row[: row.index("</tr>")]
    assert '<span class="durable-use-count">2 / 2</span>' in row and "FULL" in row
    assert '<span class="durable-override" title="set by an operator; the code\'s limit is 3">override</span>' in row
    assert (
        admin_client.get(reverse("admin:durable_concurrencylock_changelist") + "?use=full").content.decode().count(">acme</a>")
        == 1
    )

    # The key's page: the limit in effect, where it comes from, and the trail with who and why.
    detail = admin_client.get(reverse("admin:durable_concurrencylock_change", args=[quote("acme")])).content.decode()
    assert "<strong>2</strong>, an operator's override (the code's limit: 3)" in detail
    assert f"<td>{admin_user.get_username()}</td><td>3 &rarr; 2</td><td>incident 42</td>" in detail
    assert f'href="{ADD_URL}?key=acme"' in detail

    admin_client.post(ADD_URL, {"key": "acme", "limit": "", "reason": "resolved"})
    detail = admin_client.get(reverse("admin:durable_concurrencylock_change", args=[quote("acme")])).content.decode()
    assert "3 (from the code)" in detail
    assert "<td>2 &rarr; 3 (cleared)</td><td>resolved</td>" in detail
    page = admin_client.get(reverse("admin:durable_concurrencylock_changelist")).content.decode()
    row = page[page.index(">acme</a>") :]
    assert '<span class="durable-use-count">2 / 3</span>' in row[: row.index("</tr>")]
    assert "durable-override" not in row[: row.index("</tr>")]
