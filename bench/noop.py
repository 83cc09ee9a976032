"""The one-step workflow of section (g), as users declare it.

Imported by (g)'s Celery worker (``celery worker --include bench.noop``), which
executes its runs, and by the benchmark's parent process, which starts them.
Its one step calls a function that does nothing: the same no-op job as
procrastinate's in ``bench.procrastinate_app``.
"""

from __future__ import annotations

from typing import Any

from durable import DurableWorkflow

WORKFLOW = "bench.noop"
VERSION = "1"


def noop(round: str) -> None:
    return None


class Noop(DurableWorkflow):
    name = WORKFLOW
    version = VERSION

    def run(self, ctx: Any, input: Any) -> None:
        ctx.step("noop", noop, input["round"])
