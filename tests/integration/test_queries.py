"""The queries of a start (few, the count an index range scan) and of a run's execution
(one round trip per state change on PostgreSQL)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import TestCase
from django.utils import timezone

from durable import Concurrency, Engine, RunStatus, Strategy
from durable.models import RunTag, StepSlot, WorkflowRun
from durable.runtime import Registry
from durable.stores import RunRecord, StepEntry
from tests.queries import one_step_run_statements, one_step_workflow, statements

pytestmark = pytest.mark.django_db


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None, Concurrency(key=lambda i: i["key"], limit=100))
    return Engine(dispatch=lambda engine, run: None, registry=registry)


#: PostgreSQL: one call of the function durable_admit. Elsewhere: SELECT ... FOR UPDATE,
#: COUNT, INSERT run, INSERT tag, between SAVEPOINT and RELEASE (the test's own
#: transaction turns the start's BEGIN/COMMIT into a savepoint).
def start_queries() -> int:
    return 1 if connection.vendor == "postgresql" else 6


def test_start_on_a_known_key_is_lock_count_insert_run_insert_tag(engine: Engine, django_assert_num_queries) -> None:
    engine.start("w", {"key": "tenant:a"})  # creates the lock row
    with django_assert_num_queries(start_queries()) as captured:
        handle = engine.start("w", {"key": "tenant:a"})
    sql = [query["sql"] for query in captured.captured_queries]
    if connection.vendor == "postgresql":  # the four statements run inside the function
        assert sql[0].startswith("SELECT * FROM durable_admit(")
    else:
        steps = [
            ('SELECT "durable_concurrencylock"', "FOR UPDATE" if connection.features.has_select_for_update else ""),
            ('SELECT COUNT(*) AS "__count" FROM "durable_runtag"', "concurrency:tenant:a"),
            ('INSERT INTO "durable_workflowrun"', ""),
            ('INSERT INTO "durable_runtag"', "concurrency:tenant:a"),
        ]
        assert sql[0].startswith("SAVEPOINT") and sql[-1].startswith("RELEASE SAVEPOINT"), sql
        for (start, part), statement in zip(steps, sql[1:-1], strict=True):
            assert statement.startswith(start) and part in statement, (start, statement)
    # What they wrote: the run and its tag, the second on the key.
    assert RunTag.objects.filter(tag="concurrency:tenant:a").count() == 2
    assert RunTag.objects.filter(tag="concurrency:tenant:a", run__run_id=handle.run_id).exists()


def test_start_with_explicit_run_id_adds_one_lookup(engine: Engine, django_assert_num_queries) -> None:
    engine.start("w", {"key": "tenant:a"})
    with django_assert_num_queries(start_queries() + 1):
        engine.start("w", {"key": "tenant:a"}, run_id="explicit-1")
    with django_assert_num_queries(1):  # idempotent re-start: one read, no lock
        engine.start("w", {"key": "tenant:a"}, run_id="explicit-1")


def _plan(sql: str, params: list[Any]) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # tiny tables: ask what the planner can use
        cursor.execute(f"EXPLAIN {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("statuses", "index"),
    [
        (["pending", "running", "suspended", "blocked"], "durable_tag_slot_idx"),
        (["running"], "durable_tag_slot_idx"),
        (["running", "completed"], "durable_tag_count_idx"),
    ],
)
def test_quota_count_uses_a_tag_status_index(engine: Engine, statuses: list[str], index: str) -> None:
    """The ORM's count (statuses as values): the partial index of the runs holding a
    slot when the statuses are among its own, else (tag, status)."""
    engine.start("w", {"key": "tenant:a"})
    sql = "SELECT COUNT(*) FROM durable_runtag WHERE tag = %s AND status = ANY(%s)"
    plan = _plan(sql, ["concurrency:tenant:a", statuses])
    assert index in plan, plan


def _index_scans(node: dict[str, Any]) -> dict[str, int]:
    """The indexes an EXPLAIN (ANALYZE, FORMAT JSON) plan reads, each with its loops (0: never run)."""
    scans = {node["Index Name"]: node["Actual Loops"]} if "Index Name" in node else {}
    for child in node.get("Plans", []):
        scans.update(_index_scans(child))
    return scans


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("statuses", "read", "not_run"),
    [
        ("{pending,running,suspended,blocked}", "durable_tag_slot_idx", "durable_tag_count_idx"),
        ("{running}", "durable_tag_slot_idx", "durable_tag_count_idx"),
        ("{running,completed}", "durable_tag_count_idx", "durable_tag_slot_idx"),
    ],
)
def test_the_functions_count_reads_the_slot_index_in_a_generic_plan(
    engine: Engine, statuses: str, read: str, not_run: str
) -> None:
    """durable_counted_tags is inlined (no function scan) and, planned without its
    arguments' values as durable's functions are, reads the partial index unless the
    statuses name a terminal one; the other branch is not run."""
    engine.start("w", {"key": "tenant:a"})
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # tiny tables: ask what the planner can use
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(
            "PREPARE durable_count_probe(text[], text[], text) AS SELECT count(*) FROM durable_counted_tags($1, $2, $3)"
        )
        try:
            # Literals: EXECUTE takes no bound parameters (Django's server_side_binding sends them so).
            cursor.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE durable_count_probe('{{concurrency:tenant:a}}', '{statuses}', NULL)"
            )
            [[explained]] = cursor.fetchall()
        finally:
            cursor.execute("DEALLOCATE durable_count_probe")
    plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]
    assert "Function Scan" not in json.dumps(plan), plan
    assert _index_scans(plan) == {read: 1, not_run: 0}, plan


# -- a run's lifecycle: one round trip per state change (PostgreSQL) -----------------------------
@pytest.mark.postgres
def test_claim_with_the_journal_read_is_one_call(engine: Engine, django_assert_num_queries) -> None:
    handle = engine.start("w", {"key": "tenant:a"})
    with django_assert_num_queries(1) as captured:
        claimed = engine.store.claim_journal(handle.run_id, lease="l", worker="w", stale_before=timezone.now())
    assert captured.captured_queries[0]["sql"].startswith("SELECT durable_take(")
    assert claimed is not None and claimed[0].status == RunStatus.RUNNING and claimed[1] == []
    assert set(RunTag.objects.filter(run__run_id=handle.run_id).values_list("status", flat=True)) == {"running"}
    with django_assert_num_queries(1):  # not to be executed: one call too
        live = timezone.now() - timedelta(hours=1)
        assert engine.store.claim_journal(handle.run_id, lease="x", worker="w", stale_before=live) is None


@pytest.mark.postgres
def test_a_journal_write_is_one_call_with_its_heartbeat_and_lease_check(engine: Engine, django_assert_num_queries) -> None:
    handle = engine.start("w", {"key": "tenant:a"})
    store = engine.store
    assert store.claim_journal(handle.run_id, lease="l", worker="w", stale_before=timezone.now())
    beat = store.get_run(handle.run_id).heartbeat_at
    with django_assert_num_queries(1):
        assert store.record_step(handle.run_id, "l", StepEntry(0, "a", "waiting", output={"until": "t"}))
    with django_assert_num_queries(1):  # replaces the waiting entry
        assert store.record_step(handle.run_id, "l", StepEntry(0, "a", "completed", output=3))
    with django_assert_num_queries(1):  # not this lease's: writes nothing and says so
        assert store.record_step(handle.run_id, "other", StepEntry(1, "b", "completed")) is False
    assert [(s.name, s.outcome, s.output) for s in store.load_steps(handle.run_id)] == [("a", "completed", 3)]
    assert store.get_run(handle.run_id).heartbeat_at > beat


@pytest.mark.postgres
def test_finish_is_one_call(engine: Engine, django_assert_num_queries) -> None:
    handle = engine.start("w", {"key": "tenant:a"})
    assert engine.store.claim_journal(handle.run_id, lease="l", worker="w", stale_before=timezone.now())
    with django_assert_num_queries(1):
        assert not engine.store.finish(handle.run_id, "other", status=RunStatus.COMPLETED)
    with django_assert_num_queries(1):
        assert engine.store.finish(handle.run_id, "l", status=RunStatus.COMPLETED, output={"x": 1})
    assert set(RunTag.objects.filter(run__run_id=handle.run_id).values_list("status", flat=True)) == {"completed"}


@pytest.mark.postgres
def test_durable_finish_still_ends_a_run_for_workers_of_the_previous_release(engine: Engine) -> None:
    """durable_finish (what a worker of the previous release calls while a deploy
    rolls) answers as before: true for the run's own lease, false otherwise."""
    handle = engine.start("w", {"key": "tenant:a"})
    assert engine.store.claim_journal(handle.run_id, lease="l", worker="w", stale_before=timezone.now())
    call = "SELECT durable_finish(%s, %s, 'completed', NULL, NULL, now())"
    with connection.cursor() as cursor:
        cursor.execute(call, [handle.run_id, "other"])
        assert cursor.fetchone()[0] is False
        cursor.execute(call, [handle.run_id, "l"])
        assert cursor.fetchone()[0] is True
    assert engine.get_run(handle.run_id).status == RunStatus.COMPLETED
    assert set(RunTag.objects.filter(run__run_id=handle.run_id).values_list("status", flat=True)) == {"completed"}


#: A one-step run on PostgreSQL: durable_take (with the journal; it proves the run
#: this execution's, so the first step reads nothing before it runs),
#: durable_record_step and durable_end. A run with quota keys stops there too when
#: durable_end held each key's lock and found no queued run; else, on the finish's
#: commit, durable_promote hands on the slots it freed (it reads the run's keys itself).
ONE_STEP_RUN = [
    "SELECT durable_take(",
    "SELECT durable_record_step(",
    "SELECT durable_end(",
]


@pytest.mark.postgres
def test_a_one_step_run_is_three_statements(engine: Engine) -> None:
    sql = one_step_run_statements(engine)
    print(f"a one-step run executes {len(sql)} SQL statements")
    assert len(sql) == len(ONE_STEP_RUN), sql
    for start, statement in zip(ONE_STEP_RUN, sql, strict=True):
        assert statement.startswith(start), (start, statement)


@pytest.mark.postgres
def test_a_one_step_run_with_a_quota_key_and_nothing_queued_is_three_statements(engine: Engine) -> None:
    engine.register("queries.keyed", "1", one_step_workflow, Concurrency(key=lambda i: "k", limit=2))
    sql = one_step_run_statements(engine, "queries.keyed")
    assert len(sql) == len(ONE_STEP_RUN), sql
    for start, statement in zip(ONE_STEP_RUN, sql, strict=True):
        assert statement.startswith(start), (start, statement)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_finish_hands_off_when_a_starter_holds_its_keys_lock(engine: Engine) -> None:
    """durable_end only tries the key's lock: held by another transaction (a starter
    of the key, which may be queueing a run right now), the finish does not wait,
    and durable_promote follows its commit, as for a key with a queued run."""
    engine.register("queries.keyed", "1", one_step_workflow, Concurrency(key=lambda i: "held", limit=2))
    engine.register("queries.free", "1", one_step_workflow, Concurrency(key=lambda i: "free", limit=2))
    runs = {name: engine.start(name, {"n": 1}) for name in ("queries.keyed", "queries.free")}
    with psycopg.connect(**connection.get_connection_params()) as other:  # a transaction, until the block ends
        other.execute("SELECT 1 FROM durable_concurrencylock WHERE key = 'held' FOR UPDATE")
        held, free = (statements(lambda run_id=run.run_id: engine.execute(run_id)) for run in runs.values())
    assert all(run.result(timeout=1) == 2 for run in runs.values())
    assert [statement.split("(")[0] for statement in held] == [
        *(start.rstrip("(") for start in ONE_STEP_RUN),
        "SELECT durable_promote",
    ], held
    assert len(free) == len(ONE_STEP_RUN), free  # a key nobody holds: no hand-off


# -- GROUP_ROUND_ROBIN: a queued start and a hand-off (PostgreSQL) ------------------------------
@pytest.fixture
def grr_engine() -> Engine:
    registry = Registry()
    registry.register(
        "g", "1", lambda ctx, input: None, Concurrency(key=lambda i: i["key"], limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)
    )
    sent: list[RunRecord] = []
    engine = Engine(dispatch=lambda engine, run: sent.append(run), registry=registry)
    engine.sent = sent  # type: ignore[attr-defined]
    return engine


@pytest.mark.postgres
def test_a_queued_start_is_two_calls(grr_engine: Engine, django_assert_num_queries) -> None:
    first = grr_engine.start("g", {"key": "k"})
    assert first.status == RunStatus.PENDING
    # durable_admit_queued creates it queued; on commit durable_promote finds the key full.
    with django_assert_num_queries(2) as captured, TestCase.captureOnCommitCallbacks(execute=True):
        queued = grr_engine.start("g", {"key": "k"})
    sql = [query["sql"] for query in captured.captured_queries]
    assert sql[0].startswith("SELECT * FROM durable_admit_queued(") and sql[1].startswith("SELECT durable_promote("), sql
    assert queued.status == RunStatus.QUEUED
    assert set(RunTag.objects.filter(run__run_id=queued.run_id).values_list("status", flat=True)) == {"queued"}


def _binds_on_client() -> bool:
    """Whether Django's connection binds parameters on the client (psycopg's ClientCursor,
    Django's default; CI also runs these tests with server_side_binding)."""
    with connection.cursor() as cursor:
        return isinstance(cursor.cursor, psycopg.ClientCursor)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_queued_start_of_its_own_sends_its_promote_in_the_same_call(grr_engine: Engine, django_assert_num_queries) -> None:
    """Outside any transaction, durable_admit_queued and the promote on its commit go as one
    statement list ("...; COMMIT; ..."), on a connection that binds on the client."""
    grr_engine.start("g", {"key": "k"})
    one_call = _binds_on_client()
    with django_assert_num_queries(1 if one_call else 2) as captured:
        queued = grr_engine.start("g", {"key": "k"})
    sql = [query["sql"] for query in captured.captured_queries]
    assert sql[0].startswith("SELECT * FROM durable_admit_queued(")
    if one_call:
        assert "; COMMIT; SELECT durable_promote(" in sql[0], sql
    else:
        assert sql[1].startswith("SELECT durable_promote("), sql
    assert queued.status == RunStatus.QUEUED
    assert grr_engine.get_run(queued.run_id).status == RunStatus.QUEUED
    assert set(RunTag.objects.filter(run__run_id=queued.run_id).values_list("status", flat=True)) == {"queued"}
    assert not connection.in_atomic_block and connection.get_autocommit()  # the list left no transaction open
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")  # nor the promote's async commit on the session
        assert cursor.fetchone()[0] == "on"


def _strand(grr_engine: Engine) -> tuple[str, str]:
    """A key (limit 1) with a free slot and a queued run: its running run ended without
    the promote that would have handed the slot on. Returns (ended, stranded) run ids."""
    first = grr_engine.start("g", {"key": "k"})
    stranded = grr_engine.start("g", {"key": "k"})
    assert stranded.status == RunStatus.QUEUED
    assert grr_engine.store.transition(first.run_id, from_statuses=["pending"], to="completed")
    return first.run_id, stranded.run_id


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_promote_in_a_queued_starts_call_hands_a_free_slot_on_and_its_run_is_sent(grr_engine: Engine) -> None:
    _, stranded = _strand(grr_engine)
    sent_before = len(grr_engine.sent)  # type: ignore[attr-defined]
    # A start behind a queued run is queued too (fairness); its commit's promote hands the slot on.
    queued = grr_engine.start("g", {"key": "k"})
    assert queued.status == RunStatus.QUEUED
    assert grr_engine.get_run(stranded).status == RunStatus.PENDING
    assert grr_engine.get_run(queued.run_id).status == RunStatus.QUEUED
    assert [run.run_id for run in grr_engine.sent[sent_before:]] == [stranded]  # type: ignore[attr-defined]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_failed_promote_after_a_queued_starts_commit_keeps_the_start_and_promotes_again(
    grr_engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from durable.stores import admitting

    if not _binds_on_client():
        pytest.skip("a connection that binds on the server sends the promote in a call of its own")
    _, stranded = _strand(grr_engine)
    # The promote part fails (at run time, once the start has committed) when the run is queued.
    # It takes durable_promote's six parameters, then the run id.
    failing = (
        "SELECT 1 / 0 FROM (SELECT %s::jsonb, %s::text, %s::text, %s::jsonb, %s::timestamptz, %s::boolean) AS p,"
        " durable_workflowrun WHERE run_id = %s AND status = 'queued'"
    )
    monkeypatch.setattr(admitting, "_PROMOTE_IF_QUEUED", failing)
    with caplog.at_level("WARNING", logger="durable.stores.admitting"):
        queued = grr_engine.start("g", {"key": "k"})
    assert queued.status == RunStatus.QUEUED  # the start stands: it committed
    assert "The promote after queued run" in caplog.text and "division by zero" in caplog.text
    # The engine promoted again (on the commit, at once outside a transaction).
    assert grr_engine.get_run(stranded).status == RunStatus.PENDING
    assert stranded in [run.run_id for run in grr_engine.sent]  # type: ignore[attr-defined]
    assert WorkflowRun.objects.filter(workflow="g").count() == 3  # one run per start, nothing twice


@pytest.mark.postgres
def test_a_hand_off_is_a_finish_and_one_promote(grr_engine: Engine, django_assert_num_queries) -> None:
    first = grr_engine.start("g", {"key": "k"})
    queued = grr_engine.start("g", {"key": "k"})
    claimed = grr_engine.store.claim_journal(first.run_id, lease="l", worker="w", stale_before=timezone.now())
    assert claimed is not None
    with django_assert_num_queries(2) as captured, TestCase.captureOnCommitCallbacks(execute=True):
        grr_engine.executor.finish(claimed[0], "l", RunStatus.COMPLETED)
    sql = [query["sql"] for query in captured.captured_queries]
    assert sql[0].startswith("SELECT durable_end(") and sql[1].startswith("SELECT durable_promote("), sql
    assert grr_engine.get_run(queued.run_id).status == RunStatus.PENDING
    # The run durable_promote started went to the dispatcher, as read back by it.
    handed = grr_engine.sent[-1]  # type: ignore[attr-defined]
    assert (handed.run_id, handed.status, handed.workflow, handed.generation) == (queued.run_id, "pending", "g", 0)
    assert handed.dispatched_at is not None and handed.created_at is not None
    assert set(RunTag.objects.filter(run__run_id=queued.run_id).values_list("status", flat=True)) == {"pending"}


@pytest.mark.postgres
def test_a_hand_off_inside_a_callers_transaction_leaves_its_commit_synchronous(grr_engine: Engine) -> None:
    """durable_promote commits asynchronously only as a transaction of its own: inside
    a caller's transaction (here the test's) it never changes how that one commits."""
    first = grr_engine.start("g", {"key": "k"})
    queued = grr_engine.start("g", {"key": "k"})
    assert grr_engine.store.transition(first.run_id, from_statuses=["pending"], to="completed")
    assert connection.in_atomic_block
    assert grr_engine.promoter.promote(run_id=first.run_id) == [queued.run_id]
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"


@pytest.mark.postgres
def test_a_step_slots_release_with_its_hand_off_is_one_call(engine: Engine, django_assert_num_queries) -> None:
    """A step of a step-level quota ended: giving its slot back and handing it to the
    oldest waiting step is one call of durable_release_slot (the lock, the delete, the
    waiters, the count and the grant inside it)."""
    engine.register("plain", "1", lambda ctx, input: None)
    store = engine.store
    runs = [engine.start("plain", {}).run_id for _ in range(3)]
    lease = {run_id: f"lease-{n}" for n, run_id in enumerate(runs)}
    for run_id in runs:
        assert store.claim(run_id, lease=lease[run_id], worker="w", stale_before=timezone.now()) is not None
    answers = []
    for run_id in runs:  # taking a slot, and parking for one, is one call each: durable_acquire_slot
        with django_assert_num_queries(1) as captured:
            answers.append(store.acquire_slot(run_id, lease[run_id], 0, key="slots:k", limit=1, queue=True))
        assert captured.captured_queries[0]["sql"].startswith("SELECT durable_acquire_slot(")
    assert [(a.outcome, a.active, a.limit) for a in answers] == [("held", 1, 1), ("waiting", 1, 1), ("waiting", 1, 1)]
    parked = engine.get_run(runs[1])
    assert (parked.status, parked.record.waiting_for, parked.record.lease, parked.record.attempt) == (
        RunStatus.SUSPENDED,
        "slot:slots:k",
        "",
        0,  # its claim's attempt taken back
    )
    with django_assert_num_queries(1) as captured:
        woken = store.release_slot(runs[0], 0, key="slots:k", lease=lease[runs[0]])
    assert captured.captured_queries[0]["sql"].startswith("SELECT durable_release_slot(")
    assert woken == [runs[1]]  # the oldest waiter, and only one: the limit is 1
    slots = StepSlot.objects.order_by("id").values_list("run__run_id", "status", "lease")
    assert list(slots) == [(runs[1], "held", ""), (runs[2], "waiting", "")]
    # A release by a lease that no longer holds the slot changes nothing and hands nothing on.
    with django_assert_num_queries(1):
        assert store.release_slot(runs[0], 0, key="slots:k", lease=lease[runs[0]]) == []
    assert list(slots.all()) == [(runs[1], "held", ""), (runs[2], "waiting", "")]
    # The woken run's next execution takes up the slot handed to it: one call, no count.
    assert store.transition(runs[1], from_statuses=[RunStatus.SUSPENDED], to=RunStatus.PENDING)  # its wake-up
    assert store.claim(runs[1], lease="lease-9", worker="w", stale_before=timezone.now()) is not None
    with django_assert_num_queries(1):
        assert store.acquire_slot(runs[1], "lease-9", 0, key="slots:k", limit=1, queue=True).outcome == "held"
    assert list(slots.all()) == [(runs[1], "held", "lease-9"), (runs[2], "waiting", "")]


@pytest.mark.postgres
def test_a_step_slots_release_wakes_the_run_handed_the_slot_in_the_same_call(engine: Engine, django_assert_num_queries) -> None:
    """In an execution the release also moves the run handed the slot back to pending
    (the caller sends it), unless one of its run-level keys does not count a parked
    run: coming back must count that key again under its lock, so it is only named."""
    engine.register("plain", "1", lambda ctx, input: None)
    engine.register("keyed", "1", lambda ctx, input: None, Concurrency(key="tenant", limit=5, count_statuses=["running"]))
    store = engine.store
    runs = [engine.start("plain", {}).run_id, engine.start("plain", {}).run_id, engine.start("keyed", {}).run_id]
    lease = {run_id: f"lease-{n}" for n, run_id in enumerate(runs)}
    for run_id in runs:
        assert store.claim(run_id, lease=lease[run_id], worker="w", stale_before=timezone.now()) is not None
    for run_id in runs:
        store.acquire_slot(run_id, lease[run_id], 0, key="slots:k", limit=1, queue=True)
    with django_assert_num_queries(1) as captured:
        started, wake = store.release_slot_waking(runs[0], 0, key="slots:k", lease=lease[runs[0]])
    assert captured.captured_queries[0]["sql"].startswith("SELECT durable_release_slot(")
    assert [(run.run_id, run.status, run.waiting_for, run.workflow) for run in started] == [(runs[1], "pending", "", "plain")]
    assert wake == []
    assert engine.get_run(runs[1]).status == RunStatus.PENDING
    assert set(RunTag.objects.filter(run__run_id=runs[1]).values_list("status", flat=True)) <= {"pending"}
    # The keyed run counts only running runs on its key: it is named, and stays parked for the caller.
    claimed = store.claim(runs[1], lease="lease-x", worker="w", stale_before=timezone.now())
    assert claimed is not None
    assert store.acquire_slot(runs[1], "lease-x", 0, key="slots:k", limit=1, queue=True).outcome == "held"
    started, wake = store.release_slot_waking(runs[1], 0, key="slots:k", lease="lease-x")
    assert (started, wake) == ([], [runs[2]])
    run = engine.get_run(runs[2])
    assert (run.status, run.record.waiting_for) == (RunStatus.SUSPENDED, "slot:slots:k")
