"""Every endpoint renders in DRF's browsable API (a browser's ``Accept: text/html``)."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from durable import schedules
from tests.api.helpers import start_add

pytestmark = pytest.mark.django_db

HTML = {"HTTP_ACCEPT": "text/html"}


@pytest.fixture
def session(user: Any) -> APIClient:
    """A browser: logged in through the session, asking for HTML."""
    client = APIClient()
    client.force_login(user)
    return client


def test_every_endpoint_renders_as_html(session: APIClient, api: APIClient) -> None:
    run_id = start_add(api, key="html").json()["run_id"]
    schedules.create_schedule("html-nightly", "test.add", {"a": 1, "b": 2}, every=3600)
    pages = {
        "/durable/runs/": 200,
        f"/durable/runs/{run_id}/": 200,
        f"/durable/runs/{run_id}/cancel/": 405,  # POST only: the page shows the form
        f"/durable/runs/{run_id}/signal/": 405,
        "/durable/quotas/": 200,
        "/durable/quotas/html/": 200,
        "/durable/schedules/": 200,
        "/durable/schedules/html-nightly/": 200,
        "/durable/schedules/html-nightly/pause/": 405,
        "/durable/schedules/html-nightly/resume/": 405,
        "/durable/runs/no-such-run/": 404,
    }
    for url, expected in pages.items():
        response = session.get(url, **HTML)
        assert (response.status_code, response["Content-Type"]) == (expected, "text/html; charset=utf-8"), url
        page = response.content.decode()
        assert "<!DOCTYPE html>" in page and "Django REST framework" in page, url
