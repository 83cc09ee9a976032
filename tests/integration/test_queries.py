"""The start path's queries: few, and the count is an index range scan."""

from __future__ import annotations

import pytest
from django.db import connection

from durable import Concurrency, Engine
from durable.models import RunTag
from durable.runtime import Registry

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


@pytest.mark.postgres
def test_quota_count_uses_the_tag_status_index(engine: Engine) -> None:
    engine.start("w", {"key": "tenant:a"})
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # tiny tables: ask what the planner can use
        cursor.execute(
            "EXPLAIN SELECT COUNT(*) FROM durable_runtag WHERE tag = %s AND status = ANY(%s)",
            ["concurrency:tenant:a", ["pending", "running", "suspended", "blocked"]],
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "durable_tag_count_idx" in plan, plan
