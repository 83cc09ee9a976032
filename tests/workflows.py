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


def _log(path: str, line: str) -> None:
    with open(path, "a") as log:
        log.write(line + "\n")


def prepare(path: str) -> str:
    _log(path, "prepare")
    return "prepared"


def slow(path: str, release: str) -> str:
    """Log that it started, then block until the ``release`` file exists."""
    import os
    import time

    _log(path, "slow-start")
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
    return "slow-done"


class CrashyWorkflow(DurableWorkflow):
    """Two steps logging to a file, so calls can be counted across processes."""

    name = "test.crashy"
    concurrency = Concurrency(key=lambda input: input["key"], limit=1)

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
        first = ctx.step("prepare", prepare, input["log"])
        second = ctx.step("slow", slow, input["log"], input["release"])
        return {"steps": [first, second]}
