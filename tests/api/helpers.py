"""URLs and small helpers shared by the API tests."""

from __future__ import annotations

from typing import Any

from django.urls import reverse

from durable import models


def runs_url() -> str:
    return reverse("durable:run-list")


def run_url(run_id: str) -> str:
    return reverse("durable:run-detail", args=[run_id])


def cancel_url(run_id: str) -> str:
    return reverse("durable:run-cancel", args=[run_id])


def signal_url(run_id: str) -> str:
    return reverse("durable:run-signal", args=[run_id])


def quota_url(key: str | None = None) -> str:
    return reverse("durable:quota-list") if key is None else reverse("durable:quota-detail", args=[key])


def counts() -> tuple[int, int, int]:
    """(runs, tags, steps) in the database: a refused start changes none of them."""
    return models.WorkflowRun.objects.count(), models.RunTag.objects.count(), models.StepRecord.objects.count()


def start_add(client: Any, key: str | None = "k", **fields: Any) -> Any:
    """POST runs/ for workflow ``test.add`` (at most 3 runs in flight per ``key``)."""
    return client.post(runs_url(), {"workflow": "test.add", "input": add_input(key), **fields}, format="json")


def add_input(key: str | None = "k", a: int = 1, b: int = 2) -> dict[str, Any]:
    data: dict[str, Any] = {"a": a, "b": b}
    if key is not None:
        data["key"] = key
    return data
