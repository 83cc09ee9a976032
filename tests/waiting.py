"""Workflows that sleep, wait for signals and start children (registered on the default engine)."""

from __future__ import annotations

from typing import Any

from durable import DurableWorkflow, WorkflowContext


def log(path: str, line: str) -> str:
    with open(path, "a") as out:
        out.write(line + "\n")
    return line


class SleeperWorkflow(DurableWorkflow):
    name = "test.sleeper"

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> str:
        ctx.step("before", log, input["log"], "before")
        ctx.sleep(input["seconds"])
        ctx.step("after", log, input["log"], "after")
        return "slept"


class ChildEchoWorkflow(DurableWorkflow):
    name = "test.child_echo"

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        return {"echo": input}


class ApprovalParentWorkflow(DurableWorkflow):
    """Waits for a child's result and then for a human's signal."""

    name = "test.approval_parent"

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
        child = ctx.child(ChildEchoWorkflow, {"n": input["n"]})
        decision = ctx.wait_for_signal("decision", timeout=60)
        return {"child": child, "decision": decision}
