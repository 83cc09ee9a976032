"""Counting the SQL statements durable sends (for tests and the benchmark)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import connections
from django.test import TestCase
from django.test.utils import CaptureQueriesContext

from durable import Engine


def statements(fn: Callable[[], Any], using: str = "default") -> list[str]:
    """The SQL statements ``fn`` sends on this thread's connection to ``using``,
    counted as ``django_assert_num_queries`` counts them (BEGIN, COMMIT and
    SAVEPOINT included), and those of what it leaves to run on commit (a test's
    transaction never commits: they are run as the commit would)."""
    with CaptureQueriesContext(connections[using]) as captured, TestCase.captureOnCommitCallbacks(using=using, execute=True):
        fn()
    return [query["sql"] for query in captured.captured_queries]


def one_step_workflow(ctx: Any, input: Any) -> Any:
    return ctx.step("add", lambda: input["n"] + 1)


def one_step_run_statements(engine: Engine, name: str = "queries.one_step", using: str = "default") -> list[str]:
    """Start a run of a one-step workflow (registered as ``name`` on ``engine``'s
    registry if it is not yet) and return the statements of its execution: the
    claim with the journal read, the step's journal write, the finish
    and what follows it."""
    if name not in engine.registry.names():
        engine.register(name, "1", one_step_workflow)
    handle = engine.start(name, {"n": 1})
    executed = statements(lambda: engine.execute(handle.run_id), using)
    assert handle.result(timeout=1) == 2
    return executed
