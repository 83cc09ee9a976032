"""Concurrent ``enqueue`` of a task with a quota, from threads on connections of
their own (PostgreSQL): exactly the limit is admitted."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from durable import ConcurrencyLimitError, RunStatus, engine
from durable.contrib.tasks import WORKFLOW
from tests import djtasks
from tests.threads import started

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

THREADS = 12
LIMIT = 3


def test_concurrent_enqueues_admit_exactly_the_limit(settings: Any) -> None:
    settings.TASKS = {
        "default": {
            "BACKEND": "durable.contrib.tasks.DurableBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {
                "CONCURRENCY": {"tests.djtasks.send_email": {"expression": "'mailer'", "limit": LIMIT}},
                # No Celery message: a session's in-process worker must not finish runs (freeing slots) mid-race.
                "ENGINE": "tests.djtasks.quiet_engine",
            },
        }
    }
    barrier = threading.Barrier(THREADS)

    def enqueue() -> str:
        barrier.wait(timeout=30)  # every thread has its backend and connection before any starts
        try:
            return str(djtasks.send_email.enqueue("ada@example.com").id)
        except ConcurrencyLimitError:
            return "refused"

    outcomes = [t.outcome() for t in [started(enqueue) for _ in range(THREADS)]]

    admitted = [o for o in outcomes if o != "refused"]
    assert len(admitted) == LIMIT
    assert outcomes.count("refused") == THREADS - LIMIT
    runs = engine.list_runs(workflow=WORKFLOW)
    assert sorted(r.run_id for r in runs) == sorted(admitted)
    assert {r.status for r in runs} == {RunStatus.PENDING}
