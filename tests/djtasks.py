"""Task functions of Django's tasks framework for the DurableBackend tests
(importable by worker processes: a task run imports its function by module path)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from durable import Engine
from durable.contrib.tasks.framework import NAME, TaskContext
from durable.runtime.dispatch import Dispatcher

if NAME == "django.tasks":
    from django.tasks import task
else:
    from django_tasks import task  # type: ignore[no-redef]


@task()
def add(a: int, b: int) -> int:
    return a + b


@task()
async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task()
def fail(message: str) -> None:
    raise ValueError(message)


@task(queue_name="emails")
def send_email(to: str) -> str:
    return f"sent to {to}"


@task()
def log_call(path: str, line: str) -> str:
    with open(path, "a") as out:
        out.write(line + "\n")
    return line


@task()
def slow(log: str, release: str) -> str:
    """Logs its start, then waits for the ``release`` file (at most 60 s)."""
    with open(log, "a") as out:
        out.write("slow-start\n")
    deadline = time.monotonic() + 60
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "slow-done"


@task(takes_context=True)
def whoami(context: TaskContext) -> dict[str, Any]:
    return {"id": context.task_result.id, "attempt": context.attempt}


#: An engine that sends nothing to Celery: a test executes its runs itself
#: (``quiet_engine.execute``), so a session's in-process worker never races it.
quiet_engine = Engine(dispatch=Dispatcher())
