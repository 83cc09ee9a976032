"""Workflows the tests start, registered on the default engine."""

from __future__ import annotations

import threading
from typing import Any

from durable import Concurrency, DurableWorkflow, FatalError, WorkflowContext

#: Calls of step functions, by name (in-process workers only).
CALLS: dict[str, int] = {}
_calls_lock = threading.Lock()


def count_call(name: str) -> None:
    with _calls_lock:
        CALLS[name] = CALLS.get(name, 0) + 1


def add(a: int, b: int) -> int:
    count_call("add")
    return a + b


class AddWorkflow(DurableWorkflow):
    name = "test.add"
    version = "1"
    concurrency = Concurrency(key=lambda input: input.get("key"), limit=lambda key: 3)

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
        total = ctx.step("add", add, input["a"], input["b"])
        return {"total": total}


class FatalWorkflow(DurableWorkflow):
    name = "test.fatal"

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        def boom() -> None:
            count_call("fatal")
            raise FatalError("no retry for this")

        return ctx.step("boom", boom, retries=5, backoff=0)
