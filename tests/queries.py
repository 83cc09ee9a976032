"""Counting the SQL statements durable sends (for tests and the benchmark)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections
from django.test import TestCase
from django.test.utils import CaptureQueriesContext

from durable import Engine

#: The tables that grow with the keys and the runs: no plan may read every row of them.
GROWING_TABLES = ("durable_concurrencylock", "durable_runtag", "durable_workflowrun")


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


@contextlib.contextmanager
def explained(conn: Any) -> Iterator[list[str]]:
    """The plan of each statement run on the psycopg connection ``conn`` meanwhile,
    the statements of SQL functions included, as auto_explain reports them (one
    notice each; loading the module needs a superuser, as the tests' role is)."""
    plans: list[str] = []

    def note(diagnostic: Any) -> None:
        plans.append(diagnostic.message_primary or "")

    conn.add_notice_handler(note)
    for setting in (
        "LOAD 'auto_explain'",
        "SET auto_explain.log_nested_statements = on",
        "SET auto_explain.log_level = notice",
        "SET auto_explain.log_min_duration = 0",
    ):
        conn.execute(setting)
    try:
        yield plans
    finally:
        conn.execute("SET auto_explain.log_min_duration = -1")  # off: the connection may serve on
        conn.remove_notice_handler(note)


def table_scans(plans: list[str], tables: tuple[str, ...] = GROWING_TABLES) -> list[str]:
    """The plans among ``plans`` that read every row of one of ``tables``."""
    return [plan for plan in plans if any(f"Seq Scan on {table}" in plan for table in tables)]
