"""The example workflow: a chat turn, at most 8 in flight per tenant."""

from __future__ import annotations

import time
from typing import Any

from durable import Concurrency, DurableWorkflow, WorkflowContext


def load_history(conversation_id: str) -> list[str]:
    return [f"earlier message in {conversation_id}"]


def generate_reply(message: str, history: list[str], think_seconds: float = 0.5) -> str:
    time.sleep(think_seconds)  # stands in for a call to a language model
    return f"echo: {message} ({len(history)} earlier messages)"


class ChatTurnWorkflow(DurableWorkflow):
    name = "chat.turn"
    version = "1"
    concurrency = Concurrency(key=lambda input: f"tenant:{input['tenant_id']}", limit=8)

    def run(self, ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
        history = ctx.step("load_history", load_history, input.get("conversation_id", "default"))
        think = float(input.get("think_seconds", 0.5))
        reply = ctx.step("generate", generate_reply, input["message"], history, think, retries=2, backoff=0.2)
        return {"reply": reply}
