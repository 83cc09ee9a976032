"""The other service of the remote-workflow test: the body of "test.remote_echo".

Imported only by the worker that consumes the remote queue (``--include``); the
test process declares the workflow with ``engine.register_remote``.
"""

from __future__ import annotations

from typing import Any

from durable import engine

REMOTE_QUEUE = "durable-remote-test"


def remote_echo(ctx: Any, input: Any) -> Any:
    return {"served_by": "remote", "echo": ctx.step("echo", lambda: input)}


engine.register("test.remote_echo", "1", remote_echo)
