"""durable on a Django connection with server-side parameter binding and prepared statements.

Django's psycopg 3 backend binds parameters on the client and prepares nothing by
default; ``OPTIONS = {"server_side_binding": True, "prepare_threshold": ...}`` turns on
server-side binding and psycopg's prepared statements (docs/how-to/postgres-redis.md).
Every call durable makes to its PostgreSQL functions must then still work: the
parameters reach PostgreSQL as typed values instead of literals, and each statement
runs as a prepared statement (``prepare_threshold`` 0 prepares every statement at its
first execution, the strictest setting).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection
from django.utils import timezone

from durable import Concurrency, ConcurrencyLimitError, Engine, RunStatus, Strategy
from durable.models import StepSlot
from durable.runtime import Registry
from tests.queries import one_step_workflow

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def server_binding(transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The default connection reconnects with server-side binding, every statement prepared."""
    options = {**connection.settings_dict.get("OPTIONS", {}), "server_side_binding": True, "prepare_threshold": 0}
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    yield
    connection.close()  # the next test connects with the options put back


def prepared() -> str:
    """The statements prepared on this connection, as one text."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return "\n".join(row[0] for row in cursor.fetchall())


def assert_prepared(*functions: str) -> None:
    """Each of ``functions`` was called through a statement prepared on this connection."""
    statements = prepared()
    for function in functions:
        assert function in statements, (function, statements)


@pytest.fixture
def engine(server_binding: None) -> Engine:
    registry = Registry()
    registry.register("limited", "1", one_step_workflow, Concurrency(key=lambda i: i["key"], limit=1))
    registry.register(
        "queued",
        "1",
        one_step_workflow,
        Concurrency(key=lambda i: i["key"], limit=1, strategy=Strategy.GROUP_ROUND_ROBIN),
    )
    registry.register("plain", "1", lambda ctx, input: None)
    return Engine(dispatch=lambda engine, run: None, registry=registry)


def test_the_connection_binds_on_the_server(engine: Engine) -> None:
    with connection.cursor() as cursor:
        assert type(cursor.cursor).__name__ == "ServerBindingCursor"
        cursor.execute("SELECT %s::int + 1", [1])
        assert cursor.fetchone() == (2,)
    assert "SELECT $1::int + 1" in prepared()


def test_a_start_a_refusal_and_an_execution(engine: Engine) -> None:
    handle = engine.start("limited", {"key": "k", "n": 1})
    with pytest.raises(ConcurrencyLimitError) as refused:
        engine.start("limited", {"key": "k", "n": 1})
    assert (refused.value.key, refused.value.limit, refused.value.active) == ("k", 1, 1)
    with pytest.raises(ConcurrencyLimitError):
        engine.start("limited", {"key": "k", "n": 1}, run_id="given")  # the probe of a given run id
    assert engine.store.get_run("given") is None
    engine.execute(handle.run_id)  # the claim with the journal read, the step's journal write, the finish
    assert handle.result(timeout=1) == 2
    again = engine.start("limited", {"key": "k", "n": 2}, run_id="given")  # the slot is free again
    assert engine.start("limited", {"key": "k", "n": 2}, run_id="given").run_id == again.run_id  # the run there
    engine.execute(again.run_id)
    assert again.result(timeout=1) == 3
    assert_prepared("durable_admit", "durable_take", "durable_record_step", "durable_end")


def test_a_queued_start_and_its_hand_off(engine: Engine) -> None:
    first = engine.start("queued", {"key": "g", "n": 1})
    second = engine.start("queued", {"key": "g", "n": 10})
    assert (first.status, second.status) == (RunStatus.PENDING, RunStatus.QUEUED)
    engine.execute(first.run_id)  # its finish hands the key's slot to the queued run
    assert engine.get_run(second.run_id).status == RunStatus.PENDING
    engine.execute(second.run_id)
    assert (first.result(timeout=1), second.result(timeout=1)) == (2, 11)
    assert_prepared("durable_admit_queued", "durable_promote")


def test_a_step_slot_taken_waited_for_and_handed_on(engine: Engine) -> None:
    store = engine.store
    runs = [engine.start("plain", {}).run_id for _ in range(2)]
    for n, run_id in enumerate(runs):
        assert store.claim(run_id, lease=f"lease-{n}", worker="w", stale_before=timezone.now()) is not None
    taken = [store.acquire_slot(run_id, f"lease-{n}", 0, key="slots:k", limit=1, queue=True) for n, run_id in enumerate(runs)]
    assert [(a.outcome, a.active, a.limit) for a in taken] == [("held", 1, 1), ("waiting", 1, 1)]
    assert store.release_slot(runs[0], 0, key="slots:k", lease="lease-0") == [runs[1]]
    assert list(StepSlot.objects.values_list("run__run_id", "status")) == [(runs[1], "held")]
    assert_prepared("durable_acquire_slot", "durable_release_slot")
