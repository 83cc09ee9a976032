"""``durable_admit``: the installed function is the released file, and it answers
each outcome as the generic ORM admission does."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

import durable
from durable import Concurrency, ConcurrencyLimitError, Engine, InMemoryStore
from durable.concurrency import resolve
from durable.models import ConcurrencyLock
from durable.runtime import Registry
from durable.status import DEFAULT_CONCURRENCY_STATUSES, RunStatus
from durable.stores.admitting import _RefusedKeys
from durable.stores.base import RunExists, RunRecord, estimate
from tests.queries import explained, table_scans

SQL = Path(durable.__file__).resolve().parent / "sql"
#: Each current copy in durable/sql/ and the functions its file defines.
FUNCTIONS = {
    "admit": ["durable_admit", "durable_burst_refusal", "durable_full_key", "durable_lock_pool", "durable_statuses"],
    "counting": ["durable_counted_tags"],
    "lifecycle": ["durable_take", "durable_claim", "durable_record_step", "durable_finish", "durable_end"],
    "queue": ["durable_admit_queued", "durable_promote"],
    "slots": ["durable_acquire_slot", "durable_release_slot", "durable_slot_hand_off", "durable_slots_held"],
}


def newest_migration_sql(name: str = "admit") -> Path:
    """The newest versioned file of ``name`` (``NNNN_<name>*.sql``)."""
    return sorted((SQL / "migrations").glob(f"[0-9][0-9][0-9][0-9]_{name}*.sql"))[-1]


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def normalise(sql: str) -> str:
    """The function's body and signature, whitespace and comments aside."""
    sql = re.sub(r"--[^\n]*", "", sql)
    return " ".join(sql.split()).lower()


def definitions(sql: str) -> dict[str, str]:
    """Each function a file creates, by name: its normalised ``CREATE`` statement."""
    parts = normalise(sql).split("create or replace function ")[1:]
    return {part.split("(")[0]: part for part in parts}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_the_current_copy_is_the_newest_versioned_file(name: str) -> None:
    assert (SQL / f"{name}.sql").read_text() == newest_migration_sql(name).read_text()
    assert sorted(definitions(newest_migration_sql(name).read_text())) == sorted(FUNCTIONS[name])


def test_every_current_copy_is_checked() -> None:
    assert sorted(path.stem for path in SQL.glob("*.sql")) == sorted(FUNCTIONS)


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_installed_functions_are_the_newest_versioned_file(name: str) -> None:
    released = definitions(newest_migration_sql(name).read_text())
    for function in FUNCTIONS[name]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.proname = %s", [function])
            rows = cursor.fetchall()
        assert len(rows) == 1, function  # no older overload left behind
        installed = normalise(rows[0][0])
        body = released[function]
        # pg_get_functiondef spells the header its own way; the body between $$ is verbatim.
        assert installed.split("$function$")[1] == body.split("$$")[1], function
        for parameter in re.findall(r"(p_\w+ \w+)", body.split("returns")[0]):
            assert parameter in installed, (function, parameter)


def installed_body(function: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_functiondef(%s::regproc)", [function])
        return normalise(cursor.fetchone()[0]).split("$function$")[1]


def _body(name: str, function: str) -> str:
    """The body of ``function`` in the versioned file ``name``."""
    return definitions((SQL / "migrations" / f"{name}.sql").read_text())[function].split("$$")[1]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("migration", "before", "released", "reinstalled", "function"),
    [
        ("0018_burst_admit", "0017_burst", "0018_admit", "0017_admit", "durable_admit"),
        ("0025_counted_tags", "0024_tag_slot_index", "0025_admit", "0018_admit", "durable_admit"),
        ("0026_admit_fewer_queries", "0025_counted_tags", "0026_admit", "0025_admit", "durable_admit"),
        ("0027_end_locks_by_key", "0026_admit_fewer_queries", "0027_lifecycle", "0022_lifecycle", "durable_end"),
        ("0028_admit_refusal_one_query", "0027_end_locks_by_key", "0028_admit", "0026_admit", "durable_admit"),
    ],
)
def test_a_migration_installs_its_function_and_its_reverse_the_previous_one(
    migration: str, before: str, released: str, reinstalled: str, function: str
) -> None:
    assert _body(released, function) != _body(reinstalled, function)
    try:
        call_command("migrate", "durable", before, verbosity=0)
        assert installed_body(function) == _body(reinstalled, function)
        call_command("migrate", "durable", migration, verbosity=0)
        assert installed_body(function) == _body(released, function)
    finally:
        call_command("migrate", "durable", verbosity=0)
    newest = newest_migration_sql(next(name for name, functions in FUNCTIONS.items() if function in functions))
    assert installed_body(function) == _body(newest.stem, function)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_migration_0029_adds_durable_full_key_and_its_reverse_drops_it() -> None:
    def installed() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_proc WHERE proname = 'durable_full_key'")
            return cursor.fetchone()[0] == 1

    try:
        call_command("migrate", "durable", "0028_admit_refusal_one_query", verbosity=0)
        assert not installed() and installed_body("durable_admit") == _body("0028_admit", "durable_admit")
        call_command("migrate", "durable", "0029_admit_full_key", verbosity=0)
        assert installed() and installed_body("durable_full_key") == _body("0029_admit", "durable_full_key")
    finally:
        call_command("migrate", "durable", verbosity=0)


def test_every_run_status_is_a_word_so_durable_statuses_may_read_the_json_text_as_an_array() -> None:
    # durable_statuses turns ["a", "b"] into {"a", "b"}: exact only for names without quotes, commas or backslashes.
    assert all(re.fullmatch(r"[a-z]+", status) for status in RunStatus.values)


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize(
    "statuses",
    [list(DEFAULT_CONCURRENCY_STATUSES), ["running"], list(RunStatus.values), [], ["completed", "pending"]],
)
def test_durable_statuses_is_the_arrays_elements_in_order(statuses: list[str]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT durable_statuses(%s::jsonb), ARRAY(SELECT jsonb_array_elements_text(%s::jsonb))::text[]",
            [json.dumps(statuses), json.dumps(statuses)],
        )
        converted, elements = cursor.fetchone()
    assert converted == elements == statuses


#: A call of durable_admit: the quotas, the run id, and whether that id was given.
ADMIT = "SELECT * FROM durable_admit(%s::jsonb, NULL, %s, 'w', '1', 'default', '{}'::jsonb, NULL, '', %s)"


def _call(run_id: str, quotas: list[dict[str, Any]], *, given: bool) -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        cursor.execute(ADMIT, [json.dumps(quotas), run_id, given])
        return tuple(cursor.fetchone())


def _generic(engine: Engine, run_id: str, quota: Concurrency) -> str:
    """The outcome of the generic admission (the ORM path) for the same start."""
    quotas = resolve((quota,), {})
    record = RunRecord(run_id=run_id, workflow="w", version="1", namespace="default", status="pending", input={})
    try:
        engine._admit("w", record, quotas, run_id_given=True)
    except ConcurrencyLimitError:
        return "full"
    except RunExists:
        return "exists"
    return "created"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store", ["django", "memory"])
@pytest.mark.parametrize("lock_first", [False, True])
def test_each_outcome_of_the_function_is_the_generic_paths(store: str, lock_first: bool) -> None:
    engine = Engine(InMemoryStore() if store == "memory" else None, dispatch=lambda e, r: None, registry=Registry())
    key = f"sql:{uuid.uuid4().hex}"
    payload: list[dict[str, Any]] = [{"key": key, "limit": 1, "statuses": ["pending", "running"], "group": ""}]
    if lock_first:  # the key's row taken first (its row is created by the first call) and counted once
        payload[0]["lock_first"] = True
    # The ORM path on a key of its own (the same database for the django store).
    quota = Concurrency(key=f"{key}:orm", limit=1, count_statuses=("pending", "running"))
    # created: the key has room
    outcome = _call(f"{key}:1", payload, given=True)
    assert outcome[0] == "created" and outcome[4] is not None
    assert _generic(engine, f"{key}:g1", quota) == "created"
    # full: the key is at its limit, a fresh run id
    refused = _call(f"{key}:2", payload, given=False)
    assert refused[:6] == ("full", key, 1, 1, None, None)  # nothing measured: no durations
    assert refused[6] >= 0  # the age of the run in flight
    assert _generic(engine, f"{key}:g2", quota) == "full"
    # exists: the key is full, but the given run id is taken: a re-start, never refused
    assert _call(f"{key}:1", payload, given=True)[0] == "exists"
    assert _generic(engine, f"{key}:g1", quota) == "exists"
    # exists when the key has room too
    with connection.cursor() as cursor:
        cursor.execute("UPDATE durable_runtag SET status = 'completed' WHERE tag = %s", [f"concurrency:{key}"])
        cursor.execute("UPDATE durable_workflowrun SET status = 'completed' WHERE run_id LIKE %s", [f"{key}:%"])
    assert _call(f"{key}:1", payload, given=True)[0] == "exists"
    # a refusal of a given id that is free leaves nothing behind (its probe row is deleted)
    _call(f"{key}:3", payload, given=True)
    assert _call(f"{key}:4", payload, given=True)[0] == "full"
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM durable_workflowrun WHERE run_id = %s", [f"{key}:4"])
        assert cursor.fetchone()[0] == 0


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_refusal_writes_the_keys_row_only_when_its_limit_changed() -> None:
    # The usual refusal (one more start over the same limit) writes nothing, so a
    # refusal storm on a hot key updates no row; a refusal with a new limit records it.
    key = f"sql:{uuid.uuid4().hex}"

    def payload(limit: int) -> list[dict[str, Any]]:
        return [{"key": key, "limit": limit, "statuses": ["pending", "running"], "group": ""}]

    def row() -> tuple[str, int]:
        with connection.cursor() as cursor:  # ctid: every UPDATE makes a new row version
            cursor.execute('SELECT ctid::text, "limit" FROM durable_concurrencylock WHERE key = %s', [key])
            return tuple(cursor.fetchone())  # type: ignore[return-value]

    assert _call(f"{key}:1", payload(1), given=False)[0] == "created"
    before = row()
    for n in range(3):
        assert _call(f"{key}:r{n}", payload(1), given=False)[0] == "full"
    assert row() == before
    assert _call(f"{key}:r9", payload(0), given=False)[:3] == ("full", key, 0)
    after = row()
    assert after[1] == 0 and after[0] != before[0]


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_override_on_the_keys_row_replaces_the_given_limit_and_the_row_keeps_the_codes() -> None:
    key = f"sql:{uuid.uuid4().hex}"
    payload = [{"key": key, "limit": 1, "statuses": ["pending", "running"], "group": ""}]
    assert _call(f"{key}:1", payload, given=False)[0] == "created"
    with connection.cursor() as cursor:
        cursor.execute("UPDATE durable_concurrencylock SET limit_override = 2 WHERE key = %s", [key])
    assert _call(f"{key}:2", payload, given=False)[0] == "created"  # room under 2, past the step-1 count too
    assert _call(f"{key}:3", payload, given=False)[:4] == ("full", key, 2, 2)
    with connection.cursor() as cursor:
        cursor.execute('SELECT "limit", limit_override FROM durable_concurrencylock WHERE key = %s', [key])
        assert cursor.fetchone() == (1, 2)


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_refusal_answers_the_rows_durations_and_the_age_of_the_oldest_in_flight() -> None:
    key = f"sql:{uuid.uuid4().hex}"
    payload = [{"key": key, "limit": 1, "statuses": ["pending", "running"], "group": ""}]
    assert _call(f"{key}:1", payload, given=False)[0] == "created"
    with connection.cursor() as cursor:
        cursor.execute("UPDATE durable_concurrencylock SET recent_durations = '[10, 50, 40]'::jsonb WHERE key = %s", [key])
        cursor.execute(
            "UPDATE durable_runtag SET created_at = now() - interval '15 seconds' WHERE tag = %s", [f"concurrency:{key}"]
        )
    outcome = _call(f"{key}:2", payload, given=False)
    assert outcome[0] == "full" and _json(outcome[5]) == [10, 50, 40] and 15.0 <= outcome[6] <= 16.0, outcome
    assert estimate(_json(outcome[5]), outcome[6]) == pytest.approx(25.0, abs=1.0)  # median 40 minus 15 in flight
    # At a limit of 0 nothing is measured: no estimate.
    assert _call(f"{key}:3", [{**payload[0], "limit": 0}], given=False)[:7] == ("full", key, 0, 1, None, None, None)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stale", [False, True])
def test_a_refusal_by_the_first_count_is_one_query(stale: bool) -> None:
    # The count that refuses a start of one key also reads what the refusal answers and
    # records (0028): the function runs one query for it (and the UPDATE of the key's row
    # when the limit changed), where it ran three (four).
    key = f"sql:{uuid.uuid4().hex}"
    payload = [{"key": key, "limit": 1, "statuses": ["pending", "running"], "group": ""}]
    assert _call(f"{key}:1", payload, given=False)[0] == "created"
    refused = [{**payload[0], "limit": 0 if stale else 1}]
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as conn, explained(conn) as plans:
        answer = conn.execute(ADMIT, [json.dumps(refused), f"{key}:2", False]).fetchone()
    inner = [plan for plan in plans if "durable_admit(" not in plan]
    assert answer[:4] == ("full", key, refused[0]["limit"], 1)
    assert len(inner) == (2 if stale else 1), inner  # stale: and the UPDATE of the key's row
    assert _limit_of(key) == refused[0]["limit"]


def _limit_of(key: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute('SELECT "limit" FROM durable_concurrencylock WHERE key = %s', [key])
        return int(cursor.fetchone()[0])


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_refusal_records_its_limits_on_the_rows_of_keys_counted_before_the_full_one_and_after_it() -> None:
    # Step 1 stops at the full key; the refusal records the limits on the rows of
    # the keys before it and after it.
    key = f"sql:{uuid.uuid4().hex}"
    first, second = f"{key}:a", f"{key}:b"

    def quota(key: str, limit: int) -> dict[str, Any]:
        return {"key": key, "limit": limit, "statuses": ["pending", "running"], "group": ""}

    assert _call(f"{key}:1", [quota(first, 1)], given=False)[0] == "created"  # the first key is full
    assert _call(f"{key}:2", [quota(second, 5)], given=False)[0] == "created"  # the second has room
    assert _call(f"{key}:3", [quota(first, 1), quota(second, 3)], given=False)[:2] == ("full", first)
    assert (_limit_of(first), _limit_of(second)) == (1, 3)  # after the full key
    assert _call(f"{key}:4", [quota(second, 1)], given=False)[0] == "full"  # now the second key is full
    assert _call(f"{key}:5", [quota(first, 1)], given=False)[0] == "full"
    with connection.cursor() as cursor:  # the first key has room again
        cursor.execute("UPDATE durable_runtag SET status = 'completed' WHERE tag = %s", [f"concurrency:{first}"])
    assert _call(f"{key}:6", [quota(first, 4), quota(second, 1)], given=False)[:2] == ("full", second)
    assert (_limit_of(first), _limit_of(second)) == (4, 1)  # counted before the full key


def _waits_for_a_lock(pid: int) -> bool:
    # On Django's connection, outside a transaction: pg_stat_activity is read once per transaction.
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock')", [pid])
        return bool(cursor.fetchone()[0])


def _until_it_waits_for_a_lock(pid: int, what: str) -> None:
    deadline = time.monotonic() + 10
    while not _waits_for_a_lock(pid):
        assert time.monotonic() < deadline, f"{what} never waited for the key's lock"
        time.sleep(0.01)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_start_refused_after_waiting_for_the_keys_lock_answers_the_estimate() -> None:
    # Step 1 finds room on both keys, a start admitted meanwhile fills the first, and
    # step 2 (under its lock) refuses: the answer is that key's durations and oldest
    # age, not those of the last key counted.
    key = f"sql:{uuid.uuid4().hex}"
    first, second = f"{key}:a", f"{key}:b"
    quotas = json.dumps(
        [
            {"key": first, "limit": 2, "statuses": ["pending", "running"], "group": ""},
            {"key": second, "limit": 5, "statuses": ["pending", "running"], "group": ""},
        ]
    )
    assert _call(f"{key}:1", json.loads(quotas), given=False)[0] == "created"
    with connection.cursor() as cursor:
        for row_key, durations in ((first, "[30]"), (second, "[99]")):
            cursor.execute("UPDATE durable_concurrencylock SET recent_durations = %s::jsonb WHERE key = %s", [durations, row_key])
        cursor.execute(
            "UPDATE durable_runtag SET created_at = now() - interval '15 seconds' WHERE tag = %s", [f"concurrency:{first}"]
        )
    params = connection.get_connection_params()
    answers: list[tuple[Any, ...]] = []
    with psycopg.connect(**params) as holder, psycopg.connect(**params, autocommit=True) as waiter:
        assert holder.execute(ADMIT, [quotas, f"{key}:2", False]).fetchone()[0] == "created"  # holds both keys' locks
        thread = threading.Thread(target=lambda: answers.append(waiter.execute(ADMIT, [quotas, f"{key}:3", False]).fetchone()))
        thread.start()
        _until_it_waits_for_a_lock(waiter.info.backend_pid, "the second start")
        holder.commit()
        thread.join(timeout=10)
    [answer] = answers
    assert answer[:5] == ("full", first, 2, 2, None) and _json(answer[5]) == [30] and 15.0 <= answer[6] <= 16.0, answer


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_start_refused_under_the_lock_at_a_limit_of_0_answers_no_estimate() -> None:
    # Step 1 counts the key with room (and reads its row: durations [30]); meanwhile an
    # operator sets its override to 0; step 2 reads it under the lock and refuses: at a
    # limit of 0 there is nothing to estimate, whatever step 1 read.
    key = f"sql:{uuid.uuid4().hex}"
    quotas = json.dumps([{"key": key, "limit": 2, "statuses": ["pending", "running"], "group": ""}])
    assert _call(f"{key}:1", json.loads(quotas), given=False)[0] == "created"
    with connection.cursor() as cursor:
        cursor.execute("UPDATE durable_concurrencylock SET recent_durations = '[30]'::jsonb WHERE key = %s", [key])
    params = connection.get_connection_params()
    answers: list[tuple[Any, ...]] = []
    with psycopg.connect(**params) as holder, psycopg.connect(**params, autocommit=True) as waiter:
        holder.execute("SELECT 1 FROM durable_concurrencylock WHERE key = %s FOR UPDATE", [key])
        thread = threading.Thread(target=lambda: answers.append(waiter.execute(ADMIT, [quotas, f"{key}:2", False]).fetchone()))
        thread.start()
        _until_it_waits_for_a_lock(waiter.info.backend_pid, "the start")
        holder.execute("UPDATE durable_concurrencylock SET limit_override = 0 WHERE key = %s", [key])
        holder.commit()
        thread.join(timeout=10)
    [answer] = answers
    assert answer[:7] == ("full", key, 0, 1, None, None, None), answer


def _lock_first(key: str, limit: int) -> str:
    return json.dumps([{"key": key, "limit": limit, "statuses": ["pending", "running"], "group": "", "lock_first": True}])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_lock_first_start_waits_for_a_held_row_and_counts_what_committed_meanwhile() -> None:
    # The row is held: the start counts first (room: the holder has not committed),
    # waits for the lock, and counts again under it, seeing the holder's run.
    key = f"sql:{uuid.uuid4().hex}"
    quotas = _lock_first(key, 1)
    params = connection.get_connection_params()
    answers: list[tuple[Any, ...]] = []
    with psycopg.connect(**params) as holder, psycopg.connect(**params, autocommit=True) as waiter:
        assert holder.execute(ADMIT, [quotas, f"{key}:1", False]).fetchone()[0] == "created"  # holds the key's row
        thread = threading.Thread(target=lambda: answers.append(waiter.execute(ADMIT, [quotas, f"{key}:2", False]).fetchone()))
        thread.start()
        _until_it_waits_for_a_lock(waiter.info.backend_pid, "the start")
        holder.commit()
        thread.join(timeout=10)
    [answer] = answers
    assert answer[:5] == ("full", key, 1, 1, None), answer


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_lock_first_start_into_a_full_key_whose_row_is_held_is_refused_without_waiting() -> None:
    key = f"sql:{uuid.uuid4().hex}"
    quotas = _lock_first(key, 1)
    assert _call(f"{key}:1", json.loads(quotas), given=False)[0] == "created"
    params = connection.get_connection_params()
    with psycopg.connect(**params) as holder, psycopg.connect(**params, autocommit=True) as starter:
        holder.execute("SELECT 1 FROM durable_concurrencylock WHERE key = %s FOR UPDATE", [key])
        starter.execute("SET lock_timeout = '100ms'")  # a wait for the row would raise lock_not_available
        assert starter.execute(ADMIT, [quotas, f"{key}:2", False]).fetchone()[:4] == ("full", key, 1, 1)
        holder.rollback()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_lock_first_refusal_that_took_the_row_releases_it_with_its_call() -> None:
    key = f"sql:{uuid.uuid4().hex}"
    quotas = _lock_first(key, 1)
    assert _call(f"{key}:1", json.loads(quotas), given=False)[0] == "created"
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as starter, psycopg.connect(**params) as other:
        assert starter.execute(ADMIT, [quotas, f"{key}:2", False]).fetchone()[:4] == ("full", key, 1, 1)
        row = other.execute("SELECT key FROM durable_concurrencylock WHERE key = %s FOR UPDATE NOWAIT", [key]).fetchone()
        assert row == (key,)
        other.rollback()


def _flags_sent(queries: CaptureQueriesContext) -> list[bool]:
    """For each call of durable_admit captured, whether it asked to take the key's row first."""
    return ['"lock_first": true' in q["sql"] for q in queries.captured_queries if "durable_admit(" in q["sql"]]


def _one_key(limit: Any) -> tuple[Engine, str]:
    """An engine whose workflow "w" starts on one key of the test's own, with ``limit``."""
    engine = Engine(dispatch=lambda e, r: None, registry=Registry())
    key = f"sql:{uuid.uuid4().hex}"
    engine.register("w", "1", lambda ctx, input: None, Concurrency(key=lambda input: key, limit=limit))
    return engine, key


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_start_takes_its_keys_row_first_unless_its_last_start_in_this_process_was_refused() -> None:
    engine, key = _one_key(1)
    two_keys = [Concurrency(key=lambda input: key, limit=5), Concurrency(key=lambda input: f"{key}:b", limit=5)]
    engine.register("w2", "1", lambda ctx, input: None, two_keys)
    outcomes = []
    with CaptureQueriesContext(connection) as queries:
        for _ in range(3):  # admitted; refused; refused (by durable_full_key alone)
            try:
                outcomes.append(engine.start("w", {}).run_id)
            except ConcurrencyLimitError:
                outcomes.append("refused")
        engine.cancel(outcomes[0])
        handle = engine.start("w", {})  # room again: durable_full_key says nothing, admitted after counting first
        with pytest.raises(ConcurrencyLimitError):
            engine.start("w", {})  # its row taken first again: the last start was admitted
        with transaction.atomic(), pytest.raises(ConcurrencyLimitError):
            engine.start("w", {})  # inside the caller's transaction: refused by durable_full_key
        engine.cancel(handle.run_id)
        engine.start("w2", {})  # two keys: never
    assert outcomes[1:] == ["refused", "refused"]
    assert _flags_sent(queries) == [True, True, False, True, False]
    assert _full_key_calls(queries) == 3


def _full_key_calls(queries: CaptureQueriesContext) -> int:
    return sum("durable_full_key(" in q["sql"] for q in queries.captured_queries)


def _refusal(engine: Engine, workflow: str, input: Any, **start: Any) -> tuple[ConcurrencyLimitError, list[str]]:
    """The error of a start that must be refused, and the statements it sent."""
    with CaptureQueriesContext(connection) as queries, pytest.raises(ConcurrencyLimitError) as refused:
        engine.start(workflow, input, **start)
    return refused.value, [q["sql"] for q in queries.captured_queries]


def _answer(error: ConcurrencyLimitError) -> tuple[Any, ...]:
    return (error.workflow, error.key, error.limit, error.active, error.retry_after)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_key_refused_before_is_refused_by_one_plain_query_that_sends_no_input_and_answers_the_same() -> None:
    engine, key = _one_key(2)
    for _ in range(2):
        engine.start("w", {})
    with connection.cursor() as cursor:  # a Retry-After estimated from durations: 10.5 s - the oldest run's age
        cursor.execute("UPDATE durable_concurrencylock SET recent_durations = '[10.5]' WHERE key = %s", [key])
    big = {"text": "chat history " * 500}
    first, sent = _refusal(engine, "w", big)
    assert len(sent) == 1 and "durable_admit(" in sent[0]
    second, sent = _refusal(engine, "w", big)
    assert len(sent) == 1 and "durable_full_key(" in sent[0] and "chat history" not in sent[0], sent
    assert _answer(second) == _answer(first) == ("w", key, 2, 2, 11)
    # The caller chose the run id: durable_admit, which makes sure no run has it.
    third, sent = _refusal(engine, "w", big, run_id=f"given-{uuid.uuid4().hex}")
    assert [s for s in sent if "durable_admit(" in s] and not [s for s in sent if "durable_full_key(" in s]
    assert _answer(third) == _answer(first)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_durable_full_key_leaves_to_durable_admit_a_key_with_room_or_limits_to_record() -> None:
    limits = {"limit": 2}
    engine, key = _one_key(lambda k: limits["limit"])
    runs = [engine.start("w", {}).run_id for _ in range(2)]
    _refusal(engine, "w", {})  # refused: the key is refused before from now on
    lock = ConcurrencyLock.objects.get(key=key)
    # The code's limit drops to 1: still full, but the row records 2, so durable_admit refuses and records 1.
    limits["limit"] = 1
    error, sent = _refusal(engine, "w", {})
    assert [s.split("(")[0] for s in sent] == ["SELECT * FROM durable_full_key", "SELECT * FROM durable_admit"]
    assert (error.limit, error.active) == (1, 2)
    lock.refresh_from_db()
    assert lock.limit == 1
    error, sent = _refusal(engine, "w", {})  # recorded now: durable_full_key refuses
    assert len(sent) == 1 and "durable_full_key(" in sent[0] and (error.limit, error.active) == (1, 2)
    # An operator's override of 3 leaves room: durable_full_key says nothing, durable_admit admits.
    ConcurrencyLock.objects.filter(key=key).update(limit_override=3)
    with CaptureQueriesContext(connection) as queries:
        runs.append(engine.start("w", {}).run_id)
    assert _full_key_calls(queries) == 1 and len(queries.captured_queries) == 2
    error, sent = _refusal(engine, "w", {})  # full at the override (3 runs): refused under the row's lock
    assert (error.limit, error.active) == (3, 3)
    error, sent = _refusal(engine, "w", {})
    assert len(sent) == 1 and "durable_full_key(" in sent[0] and (error.limit, error.active) == (3, 3)
    # At a limit of 0 nothing frees a slot: no estimate, RETRY_AFTER, as durable_admit answers.
    ConcurrencyLock.objects.filter(key=key).update(limit_override=0, recent_durations=[10.5])
    error, sent = _refusal(engine, "w", {})
    assert len(sent) == 1 and "durable_full_key(" in sent[0]
    assert (error.limit, error.active, error.retry_after) == (0, 3, 1)
    assert engine.count_runs() == len(runs)


def test_the_refused_keys_kept_are_the_newest_and_an_admission_forgets_its_key() -> None:
    keys = _RefusedKeys(size=2)
    for key in ("a", "b"):
        keys.note((None, key), refused=True)
    keys.note((None, "a"), refused=True)  # refused again: the newest now
    keys.note((None, "c"), refused=True)  # one too many: the oldest ("b") goes
    assert [(None, "a") in keys, (None, "b") in keys, (None, "c") in keys] == [True, False, True]
    assert ("tenant", "a") not in keys  # a key counted in another namespace is another key
    keys.note((None, "a"), refused=False)
    keys.note((None, "b"), refused=False)  # not kept: nothing to forget
    assert [(None, "a") in keys, (None, "c") in keys] == [False, True]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_no_statement_of_durable_admit_scans_the_table_of_keys() -> None:
    # The plans of each statement the function runs, as auto_explain reports them, with
    # 2,000 keys' rows analyzed: a join with the quotas was planned as a scan of them all.
    prefix = f"sql:{uuid.uuid4().hex}"
    with connection.cursor() as cursor:
        cursor.execute(
            'INSERT INTO durable_concurrencylock (key, "limit", count_statuses, rr_cursor) '
            "SELECT %s || g, 5, '[\"pending\"]', '' FROM generate_series(1, 2000) AS g",
            [f"{prefix}:many:"],
        )
        cursor.execute("ANALYZE durable_concurrencylock")
    key = f"{prefix}:hot"
    plain = [{"key": key, "limit": 1, "statuses": ["pending", "running"], "group": ""}]
    first = [dict(plain[0], lock_first=True)]
    changed = [dict(plain[0], limit=2)]
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as conn, explained(conn) as plans:
        calls = [
            (first, f"{key}:1", False),  # admitted, its row created
            (first, f"{key}:2", False),  # refused under the lock it took
            (plain, f"{key}:3", False),  # refused by the count first
            (plain, f"{key}:4", True),  # a given run id refused: the probe
            (changed, f"{key}:5", False),  # admitted with a new limit: the row updated
            (plain, f"{key}:6", False),  # refused with the old limit: the rows recorded again
        ]
        answers = [conn.execute(ADMIT, [json.dumps(q), run_id, given]).fetchone()[0] for q, run_id, given in calls]
    assert answers == ["created", "full", "full", "full", "created", "full"]
    assert any("durable_concurrencylock" in plan for plan in plans)  # the plans were read
    scans = table_scans(plans, ("durable_concurrencylock",))  # the table filled: the others hold a few rows
    assert not scans, scans
