"""A key's finished runs do not slow its starts (PostgreSQL).

Every start counts the runs of its keys in ``count_statuses``; a tenant's key keeps
every finished run's tag until the purge. The functions that count run with generic
plans, in which the statuses are an unknown array: PostgreSQL then read every tag
entry of the key, finished ones included, at each count (and the table for each one
when it read the age of the oldest run in flight). They now count through
``durable_counted_tags``, whose partial index holds the runs in flight only.

Measured from PostgreSQL's statistics: the index entries and table rows of
``durable_runtag`` that a start read, on a key with no history and on one with 2,000
finished runs (the functions as they were read 2,000 to 4,000 here)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

import durable
from durable import DEFAULT_CONCURRENCY_STATUSES, Burst, Concurrency, ConcurrencyLimitError, Engine, RunStatus, Strategy
from durable.runtime import Registry

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SQL = Path(durable.__file__).resolve().parent / "sql"
HISTORY = 2_000
#: What a count may read on a key: its runs in flight, a few index pages' worth of
#: entries besides; far below HISTORY.
BOUND = 50
POOL = "hist-pool"


@pytest.fixture(autouse=True)
def _pool(settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {POOL: 10}}


def _engine() -> Engine:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None)
    return Engine(dispatch=lambda engine, run: None, registry=registry)


def _finished(key: str, count: int) -> None:
    """``count`` completed runs tagged with ``key``, as a tenant's history."""
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH runs AS ("
            " INSERT INTO durable_workflowrun (run_id, workflow, version, namespace, status, attempt, lease, worker,"
            "  generation, queue, waiting_for, redispatches, fenced, finished_at)"
            " SELECT %s || g, 'w', '1', 'default', 'completed', 1, '', '', 0, '', '', 0, false, now()"
            " FROM generate_series(1, %s) AS g RETURNING id)"
            " INSERT INTO durable_runtag (run_id, tag, status, namespace, group_key)"
            " SELECT id, %s, 'completed', 'default', '' FROM runs",
            [f"{key}:done:", count, f"concurrency:{key}"],
        )


def _reads() -> int:
    """Index entries and table rows of durable_runtag read so far, all backends."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT (SELECT COALESCE(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname = 'durable_runtag')"
            " + (SELECT COALESCE(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'durable_runtag')"
        )
        return int(cursor.fetchone()[0])


def _read_by(call: Callable[[], object]) -> int:
    """What ``call`` read, with the generic plans a long-lived connection ends up with
    (durable_admit asks for them; the others get them after five calls)."""
    before = _reads()
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
    try:
        call()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET plan_cache_mode")
    return _reads() - before


def _refused(call: Callable[[], object]) -> Callable[[], None]:
    def refused() -> None:
        with pytest.raises(ConcurrencyLimitError):
            call()

    return refused


def _read_with_history(history: int, operation: Callable[[Engine, str], Callable[[], object]]) -> int:
    engine, key = _engine(), f"hist:{uuid.uuid4().hex[:8]}"
    _finished(key, history)
    call = operation(engine, key)
    return _read_by(call)


def _refusal(engine: Engine, key: str) -> Callable[[], object]:
    quota = Concurrency(key=key, limit=2)
    for _ in range(2):
        engine.start("w", {}, concurrency=[quota])
    return _refused(lambda: engine.start("w", {}, concurrency=[quota]))


def _admission(engine: Engine, key: str) -> Callable[[], object]:
    quota = Concurrency(key=key, limit=3)
    engine.start("w", {}, concurrency=[quota])
    return lambda: engine.start("w", {}, concurrency=[quota])


def _queued(engine: Engine, key: str) -> Callable[[], object]:
    quota = Concurrency(key=key, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)
    engine.start("w", {}, concurrency=[quota])
    return lambda: engine.start("w", {}, concurrency=[quota])


def _hand_off(engine: Engine, key: str) -> Callable[[], object]:
    quota = Concurrency(key=key, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)
    first = engine.start("w", {}, concurrency=[quota])
    second = engine.start("w", {}, concurrency=[quota])
    assert second.status == RunStatus.QUEUED

    def hand_off() -> None:
        engine.store.transition(first.run_id, from_statuses=["pending"], to="completed")
        assert engine.promoter.promote(run_id=first.run_id) == [second.run_id]

    return hand_off


def _burst_refusal(engine: Engine, key: str) -> Callable[[], object]:
    """A key at its burst ceiling (up_to): refused after counting its runs, those it
    borrowed, and its pool's."""
    quota = Concurrency(key=key, limit=1, burst=Burst(pool=POOL, up_to=2))
    for _ in range(2):
        engine.start("w", {}, concurrency=[quota])
    return _refused(lambda: engine.start("w", {}, concurrency=[quota]))


OPERATIONS = {
    "refusal": _refusal,
    "admission": _admission,
    "queued start": _queued,
    "hand-off": _hand_off,
    "burst refusal": _burst_refusal,
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_start_reads_no_finished_run_of_its_key(operation: str) -> None:
    fresh = _read_with_history(0, OPERATIONS[operation])
    with_history = _read_with_history(HISTORY, OPERATIONS[operation])
    assert fresh < BOUND
    assert with_history < BOUND, f"{operation} read {with_history} tag entries on a key with {HISTORY} finished runs"


def test_a_count_of_finished_statuses_still_counts_them() -> None:
    """A lifetime cap (count_statuses naming a terminal status) counts the history it names."""
    engine, key = _engine(), f"hist:{uuid.uuid4().hex[:8]}"
    _finished(key, 3)
    cap = Concurrency(key=key, limit=4, count_statuses=("pending", "running", "completed"))
    engine.start("w", {}, concurrency=[cap])
    with pytest.raises(ConcurrencyLimitError) as refused:
        engine.start("w", {}, concurrency=[cap])
    assert refused.value.fields["active"] == 4


def test_the_function_names_the_statuses_of_the_partial_index() -> None:
    """durable_counted_tags can read durable_tag_slot_idx only if it writes out the
    index's own statuses: the index (as installed), the function and
    DEFAULT_CONCURRENCY_STATUSES name the same ones."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'durable_tag_slot_idx'")
        [indexdef] = cursor.fetchone()
    in_index = set(re.findall(r"'(\w+)'::", indexdef.split("WHERE", 1)[1]))
    body = (SQL / "counting.sql").read_text().split("$$")[1]
    arrays = [set(found.split(",")) for found in re.findall(r"'\{([\w,]+)\}'", body)]
    lists = [set(re.findall(r"'(\w+)'", found)) for found in re.findall(r"status IN \(([^)]*)\)", body)]
    assert arrays and lists
    assert in_index == set(DEFAULT_CONCURRENCY_STATUSES)
    assert all(found == in_index for found in arrays + lists), (arrays, lists)
