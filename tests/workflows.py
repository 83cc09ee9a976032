"""Workflows the tests start, registered on the default engine."""

from __future__ import annotations

import threading
from typing import Any

from durable import Concurrency, ConcurrencyLimitError, DurableWorkflow, FatalError, Strategy, WorkflowContext

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


class NoopWorkflow(DurableWorkflow):
    """A trivial body: the race tests start it with a per-start quota and execute it."""

    name = "test.noop"

    def run(self, ctx: WorkflowContext, input: Any) -> None:
        return None


def hold(path: str, name: str, release: str, die: bool) -> str:
    """Log ``<name>:start``, then die (SIGKILL this process) or block until ``release`` exists."""
    import os
    import signal
    import time

    _log(path, f"{name}:start")
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
    _log(path, f"{name}:end")
    return name


class SlotHolderWorkflow(DurableWorkflow):
    """One slot per key, handed to queued runs in turn (GROUP_ROUND_ROBIN); one step
    logging its start and end to a file, so the order of runs is visible across processes."""

    name = "test.slot_holder"
    concurrency = Concurrency(key=lambda input: input["key"], limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
        held = ctx.step("hold", hold, input["log"], input["name"], input["release"], input.get("die", False))
        return {"held": held}


def logged_step(path: str, line: str, pause: float) -> str:
    """Log ``line`` and take ``pause`` seconds (a step with some work in it)."""
    import time

    _log(path, line)
    time.sleep(pause)
    return line


class ChaosWorkflow(DurableWorkflow):
    """Four logged steps: the chaos test counts their calls across database outages."""

    name = "test.chaos"

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> list[str]:
        return [ctx.step(f"s{i}", logged_step, input["log"], f"{ctx.run_id}:s{i}", input["pause"]) for i in range(4)]


class StepSlotWorkflow(DurableWorkflow):
    """One step under a step-level quota (limit 1 on ``input["key"]``) that logs its
    start and end, holding its slot until ``release`` exists (or dying, see ``hold``)."""

    name = "test.step_slot"

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
        quota = Concurrency(key=input["key"], limit=1)
        args = (input["log"], input["name"], input["release"], input.get("die", False))
        return {"held": ctx.step("hold", hold, *args, concurrency=quota)}


class WaitingWorkflow(DurableWorkflow):
    """Every kind of statement an execution makes past its claim and journal: a
    sleep (the run parks, a wake-up task wakes it), a wait for the signal "go" (it
    parks again, the signal wakes it and is consumed), a step under a step-level
    quota (its slot is taken and given back)."""

    name = "test.waiting"

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
        before = ctx.step("before", add, input["a"], 1)
        ctx.sleep(0.05)
        go = ctx.wait_for_signal("go")
        after = ctx.step("after", add, before, go["b"], concurrency=Concurrency(key=input["key"], limit=1))
        return {"total": after}


def gauged(pause: float) -> str:
    """A step body that counts itself in the table ``step_gauge`` while it runs
    (see tests/concurrency/test_step_quota_race.py): each UPDATE commits on its own
    and the row's lock orders them, so ``hwm`` is the most bodies inside at once."""
    import time

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("UPDATE step_gauge SET cur = cur + 1, hwm = GREATEST(hwm, cur + 1), entries = entries + 1")
    time.sleep(pause)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE step_gauge SET cur = cur - 1")
    return "done"


class StepRaceWorkflow(DurableWorkflow):
    """One gauged step under a step-level quota; with ``reject`` a full key's refusal is caught."""

    name = "test.step_race"

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> str:
        from django.db import connection

        with connection.cursor() as cursor:  # not journaled on purpose: counts every execution of the body
            cursor.execute("UPDATE step_gauge SET executions = executions + 1")
        strategy = {"strategy": Strategy.REJECT} if input.get("reject") else {}
        quota = Concurrency(key=input["key"], limit=input["limit"], **strategy)
        try:
            return ctx.step("call", gauged, input["pause"], concurrency=quota)
        except ConcurrencyLimitError:
            return "refused"
