"""What durable's indexes cost its writes, on PostgreSQL.

A heartbeat, a journal write and a re-send update a run's row in place (a HOT update):
they change no column that an index of the run table names, so no index gets a new
entry. A running run is beaten every HEARTBEAT_INTERVAL and journals every step, so
these are the run table's most frequent updates. No index repeats the start of
another on the same table: each costs every insert and every update of its columns.
And no statement of a run's way reads every row of a table that grows with the keys
and the runs."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from durable import Concurrency, DjangoStore, Engine, RunStatus, Strategy
from durable.models import WorkflowRun
from durable.retention import with_unfinished_children
from durable.runtime import Registry
from durable.stores.base import RunRecord, StepEntry
from tests.queries import GROWING_TABLES, explained, table_scans

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


def _since(before: tuple[int, int]) -> tuple[int, int]:
    """``_hot_updates`` counted from ``before`` on."""
    updated, hot = _hot_updates()
    return updated - before[0], hot - before[1]


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

    assert _since(before) == (3, 3)


def test_a_claim_changes_an_indexed_column(engine: Engine) -> None:
    """The counter can tell: the claim sets the status, which indexes name."""
    handle = engine.start("w", {"key": "tenant:a"})
    before = _hot_updates()
    assert engine.store.claim_journal(handle.run_id, lease="l", worker="w", stale_before=timezone.now())
    assert _since(before) == (1, 0)


def test_no_index_is_the_start_of_another_of_its_table() -> None:
    """An index whose columns (with their operator classes and orders) begin another index
    of its table serves nothing the longer one does not. A unique index (it enforces a
    constraint) is never the redundant one; partial and expression indexes answer other
    queries and are left out."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT t.relname, i.relname, x.indisunique, x.indkey::int2[], x.indclass::oid[], x.indoption::int2[] "
            "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid "
            "WHERE t.relname LIKE 'durable%%' AND x.indpred IS NULL AND x.indexprs IS NULL"
        )
        indexes = [
            (table, name, unique, list(zip(keys, classes, options, strict=True)))
            for table, name, unique, keys, classes, options in cursor.fetchall()
        ]
    assert {table for table, *_ in indexes} >= {"durable_workflowrun", "durable_runtag", "durable_steprecord", "durable_signal"}
    redundant = {
        (name, longer)
        for table, name, unique, columns in indexes
        for other_table, longer, _, other in indexes
        if table == other_table and not unique and len(columns) < len(other) and other[: len(columns)] == columns
    }
    assert redundant == set()


#: The tables every run's way writes.
RUN_TABLES = ("durable_workflowrun", "durable_runtag", "durable_steprecord", "durable_signal", "durable_stepslot")


def _prefix_indexes() -> set[tuple[str, str]]:
    """The indexes of RUN_TABLES for ``LIKE 'prefix%'`` only: Django adds one (with
    ``varchar_pattern_ops``) beside the index of every unique or indexed ``CharField``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tablename, indexname FROM pg_indexes WHERE tablename = ANY(%s) AND indexdef LIKE '%%pattern_ops%%'",
            [list(RUN_TABLES)],
        )
        return set(cursor.fetchall())


def test_the_tables_of_a_runs_way_have_no_prefix_index() -> None:
    """No query of durable reads them by a prefix (the run id lookups are exact, the
    admin's search is ``icontains``), and each new row version wrote such an index."""
    assert _prefix_indexes() == set()


@pytest.mark.django_db(transaction=True)
def test_migration_0030_drops_the_run_ids_prefix_index_keeps_it_unique_and_its_reverse_restores_it() -> None:
    try:
        call_command("migrate", "durable", "0029_admit_full_key", verbosity=0)
        assert _prefix_indexes() == {("durable_workflowrun", "durable_workflowrun_run_id_74502262_like")}
        call_command("migrate", "durable", "0030_run_id_without_like_index", verbosity=0)
        assert _prefix_indexes() == set()
        WorkflowRun.objects.create(run_id="r", workflow="w", version="1")
        with pytest.raises(IntegrityError, match="durable_workflowrun_run_id_key"), transaction.atomic():
            WorkflowRun.objects.create(run_id="r", workflow="w", version="1")
    finally:
        call_command("migrate", "durable", verbosity=0)


def _parent_indexes() -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes "
            "WHERE tablename = 'durable_workflowrun' AND indexdef LIKE '%%(parent_id)%%'"
        )
        return dict(cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_migration_0031_keeps_only_the_children_in_the_parent_index_and_its_reverse_all_runs() -> None:
    try:
        call_command("migrate", "durable", "0030_run_id_without_like_index", verbosity=0)
        assert _parent_indexes() == {
            "durable_workflowrun_parent_id_cbb16613": (
                "CREATE INDEX durable_workflowrun_parent_id_cbb16613 ON public.durable_workflowrun USING btree (parent_id)"
            )
        }
        call_command("migrate", "durable", "0031_run_parent_partial_index", verbosity=0)
        assert _parent_indexes() == {
            "durable_run_parent_idx": (
                "CREATE INDEX durable_run_parent_idx ON public.durable_workflowrun USING btree (parent_id) "
                "WHERE (parent_id IS NOT NULL)"
            )
        }
    finally:
        call_command("migrate", "durable", verbosity=0)


@pytest.mark.django_db(transaction=True)
def test_the_children_of_a_run_are_read_on_the_partial_parent_index() -> None:
    # 1,500 top-level runs and one parent with three children, analyzed: a cancel's
    # children, a purge's unfinished children and the children a deleted parent sets free.
    WorkflowRun.objects.bulk_create(
        (WorkflowRun(run_id=f"top-{n}", workflow="w", version="1") for n in range(1500)), batch_size=1000
    )
    parent = WorkflowRun.objects.create(run_id="parent", workflow="w", version="1", status=RunStatus.RUNNING)
    for n in range(3):
        WorkflowRun.objects.create(run_id=f"child-{n}", workflow="w", version="1", parent=parent)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE durable_workflowrun")
    connection.ensure_connection()
    with explained(connection.connection) as plans:
        assert sorted(r.run_id for r in DjangoStore().active_children("parent")) == ["child-0", "child-1", "child-2"]
        assert with_unfinished_children([parent.pk]) == {parent.pk}
        WorkflowRun.objects.filter(pk=parent.pk).delete()
    assert WorkflowRun.objects.filter(run_id__startswith="child-", parent=None).count() == 3
    read = "\n".join(plans)
    assert read.count("durable_run_parent_idx") >= 3, read
    assert not table_scans(plans, ("durable_workflowrun",)), read


@pytest.fixture
def tag_statistics(request: pytest.FixtureRequest) -> Iterator[None]:
    """The tags' statistics as analyzed ("analyzed"), or saying a run has hundreds of
    tags ("skewed": n_distinct of the tags' run_id set low), as the bench's section (a)
    left them: plans that count on one tag a run are then costed against a join of
    every key's row."""
    if request.param == "analyzed":
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE durable_runtag ALTER COLUMN run_id SET (n_distinct = 5)")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE durable_runtag ALTER COLUMN run_id RESET (n_distinct)")
            cursor.execute("ANALYZE durable_runtag")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("tag_statistics", ["analyzed", "skewed"], indirect=True)
def test_no_statement_of_a_runs_way_reads_a_whole_growing_table(engine: Engine, tag_statistics: None) -> None:
    # With 1,500 keys, runs and tags analyzed, the plans auto_explain reports for every
    # statement (those inside durable's SQL functions too) of queued starts, claims,
    # journal reads and writes, finishes and hand-offs. More than five calls of each,
    # so that PostgreSQL's generic plans, chosen after five, are read as well.
    for n in range(1500):
        engine.start("w", {"key": f"many:{n}"})
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE " + ", ".join(GROWING_TABLES))
    sent: list[RunRecord] = []
    registry = Registry()
    registry.register(
        "q",
        "1",
        lambda ctx, input: ctx.step("one", lambda: input["n"]),
        Concurrency(key=lambda input: "queued", limit=1, strategy=Strategy.GROUP_ROUND_ROBIN),
    )
    queued = Engine(dispatch=lambda engine, run: sent.append(run), registry=registry)
    connection.ensure_connection()
    with explained(connection.connection) as plans:
        handles = [queued.start("q", {"n": n}) for n in range(8)]
        assert [h.status for h in handles] == [RunStatus.PENDING] + [RunStatus.QUEUED] * 7
        while sent:  # each finish hands the key to the next queued run, sent here
            queued.execute(sent.pop(0).run_id)
    assert [queued.get_run(h.run_id).status for h in handles] == [RunStatus.COMPLETED] * 8
    read = "\n".join(plans)
    for function in ("durable_admit_queued", "durable_promote", "durable_take", "durable_record_step", "durable_end"):
        assert function in read  # the plans of each function's statements were read
    scans = table_scans(plans)
    assert not scans, scans
