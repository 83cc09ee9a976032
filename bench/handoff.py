"""Section (d)'s workflow, as the Celery worker of the benchmark runs it.

The worker imports this module (``celery worker --include bench.handoff``), which
registers the workflow on durable's default engine, the one the worker executes
runs with. The benchmark process starts the runs through an engine of its own
(``bench.queueing``), with the same name, version and quota.

The body returns the time it started executing, ``time.time()`` in the worker,
and nothing else: the run's ``finished_at`` is also taken from the worker's
clock (``timezone.now()`` when it finishes), so a hand-off's latency is the
difference of two readings of one clock.
"""

from __future__ import annotations

import time
from typing import Any

import durable
from durable import Concurrency, Strategy

WORKFLOW = "bench.handoff"
VERSION = "1"


def key_of(input: dict[str, Any]) -> str:
    return str(input["key"])


#: One run of a key at a time; the others wait ``queued`` for its slot.
CONCURRENCY = Concurrency(key=key_of, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)


def body(ctx: Any, input: Any) -> dict[str, float]:
    """Record when the body started (seconds since the epoch), and return at once."""
    return {"started": time.time()}


durable.engine.register(WORKFLOW, VERSION, body, CONCURRENCY)
