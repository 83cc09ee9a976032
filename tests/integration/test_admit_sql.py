"""``durable_admit``: the installed function is the released file, and it answers
each outcome as the generic ORM admission does."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

import durable
from durable import Concurrency, ConcurrencyLimitError, Engine, InMemoryStore
from durable.concurrency import resolve
from durable.runtime import Registry
from durable.stores.base import RunExists, RunRecord, estimate

SQL = Path(durable.__file__).resolve().parent / "sql"
#: Each current copy in durable/sql/ and the functions its file defines.
FUNCTIONS = {
    "admit": ["durable_admit", "durable_burst_refusal", "durable_lock_pool"],
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


def _call(run_id: str, quotas: list[dict[str, Any]], *, given: bool) -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT * FROM durable_admit(%s::jsonb, NULL, %s, 'w', '1', 'default', '{}'::jsonb, NULL, '', %s)",
            [json.dumps(quotas), run_id, given],
        )
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
def test_each_outcome_of_the_function_is_the_generic_paths(store: str) -> None:
    engine = Engine(InMemoryStore() if store == "memory" else None, dispatch=lambda e, r: None, registry=Registry())
    key = f"sql:{uuid.uuid4().hex}"
    payload = [{"key": key, "limit": 1, "statuses": ["pending", "running"], "group": ""}]
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
