"""What the admin tests share: URLs, the listed rows, a run of a registered workflow."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.admin.utils import quote
from django.http import HttpResponse
from django.urls import reverse
from django.utils import timezone

from durable import models
from durable.testing import WorkflowRunFactory, tagged

RUNS_URL = reverse("admin:durable_workflowrun_changelist")
QUOTAS_URL = reverse("admin:durable_concurrencylock_changelist")
SCHEDULES_URL = reverse("admin:durable_schedule_changelist")


def run_url(run: models.WorkflowRun, action: str = "change") -> str:
    return reverse(f"admin:durable_workflowrun_{action}", args=[run.pk])


def quota_url(key: str) -> str:
    return reverse("admin:durable_concurrencylock_change", args=[quote(key)])


def listed(response: HttpResponse) -> list[str]:
    """Run ids, quota keys or schedule names of the changelist page, in order."""
    assert response.status_code == 200
    return [getattr(obj, "run_id", None) or getattr(obj, "name", None) or obj.pk for obj in response.context["cl"].result_list]


def row(content: str, label: str) -> str:
    """The HTML of the changelist row whose link reads ``label``."""
    start = content.index(f">{label}</a>")
    return content[start : content.index("</tr>", start)]


def key_with(key: str, limit: int | None, *statuses: str, minutes_ago: float = 1, workflow: str = "test.add") -> None:
    """A lock row for ``key`` and one run per status, tagged with the key."""
    models.ConcurrencyLock.objects.update_or_create(key=key, defaults={"limit": limit})
    for status in statuses:
        run = WorkflowRunFactory(
            workflow=workflow,
            version="1",
            status=status,
            input={"key": key},
            created_at=timezone.now() - timedelta(minutes=minutes_ago),
        )
        tagged(run, f"concurrency:{key}")


def add_run(status: str, key: str, **fields: Any) -> models.WorkflowRun:
    """A run of the registered ``test.add`` workflow (quota: 3 per input["key"])."""
    run = WorkflowRunFactory(workflow="test.add", version="1", status=status, input={"key": key, "a": 1, "b": 2}, **fields)
    tagged(run, f"concurrency:{key}")
    return run
