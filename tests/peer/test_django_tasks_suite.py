"""The django-tasks backport's own backend tests, run against DurableBackend by
``tests/peer/run_django_tasks.py`` from a checkout of their repository (their tests
are not in the package). Skipped unless ``DJANGO_TASKS_CHECKOUT`` names one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from durable.contrib.tasks import framework

RUNNER = Path(__file__).with_name("run_django_tasks.py")
CHECKOUT = os.environ.get("DJANGO_TASKS_CHECKOUT", "")


@pytest.mark.skipif(
    not CHECKOUT,
    reason="needs a checkout of django-tasks (its tests are not in the package): set DJANGO_TASKS_CHECKOUT",
)
@pytest.mark.skipif(framework.NAME != "django_tasks", reason="their suite tests the backport (django_tasks), not django.tasks")
@pytest.mark.parametrize("store", ["memory", "django"])
def test_the_backports_backend_tests_pass_against_durable_backend(store: str) -> None:
    done = subprocess.run(
        [sys.executable, str(RUNNER), "--json", f"--store={store}"],
        env={**os.environ, "DJANGO_TASKS_CHECKOUT": CHECKOUT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["failed"] == []
    assert summary["store"] == store
    assert summary["applicable"] >= 19 and summary["passed"] == summary["applicable"]
    assert summary["task_runs"] > 0  # the tests' tasks were durable runs
