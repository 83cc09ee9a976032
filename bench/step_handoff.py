"""Section (i)'s workflow, as the Celery worker of the benchmark runs it.

The worker imports this module (``celery worker --include bench.handoff,bench.step_handoff``),
which registers the workflow on durable's default engine. Its one step runs under
a step-level quota of limit 1 on the run's key: the runs of a key wait for each
other's step, and each release hands the slot to the next waiting step.

The step's body returns when it started and when it ended, ``time.time()`` in
the worker: a step hand-off's latency is the next step's start minus the
previous step's end, two readings of one clock.
"""

from __future__ import annotations

import time
from typing import Any

import durable
from durable import Concurrency

WORKFLOW = "bench.step_handoff"
VERSION = "1"


def timed() -> dict[str, float]:
    """The step's body: when it started and ended (seconds since the epoch)."""
    started = time.time()
    return {"started": started, "ended": time.time()}


def body(ctx: Any, input: Any) -> dict[str, float]:
    return ctx.step("call", timed, concurrency=Concurrency(key=input["key"], limit=1))


durable.engine.register(WORKFLOW, VERSION, body)
