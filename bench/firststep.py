"""The workflow and the baseline task of sections (a) and (f), as users declare them.

Imported by the benchmark processes (``bench.worker``, to dispatch) and by the
Celery worker of (f) (``celery worker --include bench.firststep``, to execute).

- ``FirstStep``: a ``DurableWorkflow`` on durable's default engine (the Celery
  dispatcher), started with ``FirstStep.dispatch``. Its one step records
  ``time.time()`` as its body starts and the run returns it, so (f) reads the
  first step's start from the run's output.
- ``probe_write``: the baseline of (f), a bare Celery task that makes one
  committed database write, the least any database-backed task does: it inserts
  its token into ``PROBE_TABLE`` (a table of the scratch database) and reads
  ``time.time()`` once that INSERT is committed, as durable's first step starts
  once its claim (a committed write) is; a second statement then stores that
  reading for the benchmark to read, after the measured interval (as durable's
  step result is stored by the journal write and the finish after its reading).
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from durable import Concurrency, DurableWorkflow

WORKFLOW = "bench.first_step"
#: A quota no start of the benchmark fills (as (a)'s no-op workflow).
LIMIT = 1000
PROBE_TASK = "bench.probe_write"
PROBE_TABLE = "durable_bench_probe"
CREATE_PROBE_TABLE = f"CREATE TABLE IF NOT EXISTS {PROBE_TABLE} (token text PRIMARY KEY, started float8)"


def key_of(input: dict[str, Any]) -> str:
    return str(input["key"])


def _now() -> float:
    return time.time()


class FirstStep(DurableWorkflow):
    name = WORKFLOW
    version = "1"
    concurrency = Concurrency(key=key_of, limit=LIMIT)

    def run(self, ctx: Any, input: Any) -> dict[str, float]:
        return {"started": ctx.step("first", _now)}


@shared_task(name=PROBE_TASK, serializer="json", ignore_result=True)
def probe_write(token: str) -> None:
    """One committed INSERT (autocommit), then the time it was done; stored afterwards."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {PROBE_TABLE} (token) VALUES (%s)", [token])
        committed = time.time()
        # Not timed: how the benchmark learns the reading (durable's comes with the run's output).
        cursor.execute(f"UPDATE {PROBE_TABLE} SET started = %s WHERE token = %s", [committed, token])
