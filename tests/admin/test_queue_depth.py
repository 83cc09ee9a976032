"""A run's admin page links the run that replaced it in its key's queue (CANCEL_QUEUED_EXCEPT_NEWEST)."""

from __future__ import annotations

import pytest
from django.test import Client

import tests.workflows  # noqa: F401  (registers test.noop)
from durable import Concurrency, Engine, Strategy, models
from tests.admin.helpers import run_url

pytestmark = pytest.mark.django_db


def test_the_page_of_a_replaced_run_links_the_run_that_replaced_it(admin_client: Client) -> None:
    engine = Engine(dispatch=lambda engine, run: None)
    quota = Concurrency(key="preview:7", limit=1, strategy=Strategy.CANCEL_QUEUED_EXCEPT_NEWEST)
    first, replaced, newest = (engine.start("test.noop", {"n": i}, concurrency=quota) for i in range(3))
    page = admin_client.get(run_url(models.WorkflowRun.objects.get(run_id=replaced.run_id)))
    assert page.status_code == 200
    content = page.content.decode()
    newest_url = run_url(models.WorkflowRun.objects.get(run_id=newest.run_id))
    assert f'<a href="{newest_url}">{newest.run_id}</a>' in content
    assert "durable.cancel_queued_except_newest" in content  # the error, with its message
    # A run nobody replaced shows a dash.
    other = admin_client.get(run_url(models.WorkflowRun.objects.get(run_id=first.run_id))).content.decode()
    assert newest_url not in other
