"""A heartbeat, a journal write and a re-send update a run's row in place (PostgreSQL's
HOT update): they change no column that an index of the run table names, so no index
gets a new entry. A running run is beaten every HEARTBEAT_INTERVAL and journals every
step, so these are the run table's most frequent updates."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.utils import timezone

from durable import Concurrency, Engine
from durable.runtime import Registry
from durable.stores.base import StepEntry

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

#: The columns each of those writes sets (durable_record_step, DjangoStore.heartbeat and
#: DjangoStore.mark_dispatched); the test below checks the writes themselves.
FREQUENT = ("heartbeat_at", "dispatched_at", "redispatches")


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None, Concurrency(key=lambda i: i["key"], limit=100))
    return Engine(dispatch=lambda engine, run: None, registry=registry)


def _hot_updates() -> tuple[int, int]:
    """Updates of the run table in this transaction, and how many of them were HOT."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_stat_get_xact_tuples_updated('durable_workflowrun'::regclass), "
            "pg_stat_get_xact_tuples_hot_updated('durable_workflowrun'::regclass)"
        )
        return cursor.fetchone()


def test_no_index_of_the_run_table_names_a_column_the_frequent_writes_set() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'durable_workflowrun'")
        indexes = dict(cursor.fetchall())
    assert "durable_run_status_idx" in indexes  # what the sweeper reads instead
    named = {(name, column) for name, sql in indexes.items() for column in FREQUENT if re.search(rf"\b{column}\b", sql)}
    assert named == set()


def test_a_heartbeat_a_journal_write_and_a_resend_are_hot_updates(engine: Engine) -> None:
    handle = engine.start("w", {"key": "tenant:a"})
    assert engine.store.claim_journal(handle.run_id, lease="l", worker="w", stale_before=timezone.now())
    before = _hot_updates()

    assert engine.store.heartbeat(handle.run_id, "l")
    assert engine.store.record_step(handle.run_id, "l", StepEntry(0, "a", "completed", output=1))
    engine.store.mark_dispatched([handle.run_id])

    updated, hot = (after - was for after, was in zip(_hot_updates(), before, strict=True))
    assert (updated, hot) == (3, 3)


def test_a_claim_changes_an_indexed_column(engine: Engine) -> None:
    """The counter can tell: the claim sets the status, which indexes name."""
    handle = engine.start("w", {"key": "tenant:a"})
    before = _hot_updates()
    assert engine.store.claim_journal(handle.run_id, lease="l", worker="w", stale_before=timezone.now())
    updated, hot = (after - was for after, was in zip(_hot_updates(), before, strict=True))
    assert (updated, hot) == (1, 0)
