"""Workflows only the API tests start (imported by tests/api/conftest.py)."""

from __future__ import annotations

from typing import Any

from durable import Concurrency, DurableWorkflow, Strategy, WorkflowContext


class QueuedWorkflow(DurableWorkflow):
    """One run in flight per ``input["key"]``; one more may wait in the queue, then 429."""

    name = "api.queued"
    version = "1"
    concurrency = Concurrency(key=lambda input: input["key"], limit=1, strategy=Strategy.GROUP_ROUND_ROBIN, max_queued=1)

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        return input


class OneAtATimeWorkflow(DurableWorkflow):
    """One run in flight per ``input["key"]``; the next start is refused (429)."""

    name = "api.one"
    version = "1"
    concurrency = Concurrency(key=lambda input: input["key"], limit=1)

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        return input
