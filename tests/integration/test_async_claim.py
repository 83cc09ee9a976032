"""The claim commits asynchronously (``durable_take``) only where losing it in a crash of
the database can neither over-admit a quota nor lose a run: the run is then executed
again from its journal, as after a worker's crash."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.models import F
from django.utils import timezone

from durable import Concurrency, Engine, RunStatus
from durable.models import WorkflowRun
from durable.runtime import Registry

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None, Concurrency(key=lambda i: i["key"], limit=100))
    return Engine(dispatch=lambda engine, run: None, registry=registry)


def _take(run_id: str, *, async_commit: bool | None) -> tuple[bool, str]:
    """Call durable_take (durable_claim, the previous release's call, when ``async_commit``
    is None) inside the test's transaction: whether it claimed, and the synchronous_commit
    its transaction would commit with (set_config local to it)."""
    if async_commit is None:
        call, params = "SELECT durable_claim(%s, 'l', 'w', now(), now()) IS NOT NULL", [run_id]
    else:
        call, params = "SELECT durable_take(%s, 'l', 'w', now(), now(), %s) IS NOT NULL", [run_id, async_commit]
    with connection.cursor() as cursor:
        cursor.execute(call, params)
        claimed = cursor.fetchone()[0]
        cursor.execute("SHOW synchronous_commit")
        return claimed, cursor.fetchone()[0]


def test_a_claim_of_its_own_transaction_commits_asynchronously_under_the_default_statuses(engine: Engine) -> None:
    """Losing such a claim in a crash of the database leaves the run pending, still counted:
    no quota can over-admit, and the run is executed again from its journal."""
    assert _take(engine.start("w", {"key": "tenant:a"}).run_id, async_commit=True) == (True, "off")


def test_a_claim_inside_a_transaction_commits_synchronously(engine: Engine) -> None:
    """synchronous_commit set locally would apply to the caller's whole transaction."""
    assert _take(engine.start("w", {"key": "tenant:a"}).run_id, async_commit=False) == (True, "on")


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        (["running"], "on"),  # the claim takes the slot: losing it would free the slot under a live body
        (["pending", "running"], "on"),  # a blocked run's claim takes a slot too
        (["pending", "running", "blocked"], "off"),
        (["pending", "blocked"], "off"),  # a claim that leaves the count lower: losing it cannot over-admit
    ],
)
def test_a_claim_commits_synchronously_where_losing_it_could_over_admit(
    engine: Engine, statuses: list[str], expected: str
) -> None:
    other = engine.start("w", {"key": "tenant:a"})  # the default statuses
    handle = engine.start("w", {"key": "tenant:b"}, concurrency=Concurrency(key="k", limit=5, count_statuses=statuses))
    assert _take(other.run_id, async_commit=True) == (True, "off")
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('synchronous_commit', 'on', true)")
    assert _take(handle.run_id, async_commit=True) == (True, expected)


def test_durable_claim_still_claims_synchronously_for_workers_of_the_previous_release(engine: Engine) -> None:
    handle = engine.start("w", {"key": "tenant:a"})
    assert _take(handle.run_id, async_commit=None) == (True, "on")
    assert engine.get_run(handle.run_id).status == RunStatus.RUNNING
    assert _take(handle.run_id, async_commit=None) == (False, "on")  # live: not taken again


@pytest.mark.django_db(transaction=True)
def test_the_store_asks_for_an_asynchronous_claim_only_outside_a_transaction(engine: Engine, django_assert_num_queries) -> None:
    from django.db import transaction

    first, second = (engine.start("w", {"key": "tenant:a"}) for _ in range(2))
    with django_assert_num_queries(1) as captured:
        assert engine.store.claim_journal(first.run_id, lease="l", worker="w", stale_before=timezone.now())
    assert captured.captured_queries[0]["sql"].endswith(", true)")
    with transaction.atomic(), django_assert_num_queries(1) as captured:
        assert engine.store.claim_journal(second.run_id, lease="l", worker="w", stale_before=timezone.now())
    assert captured.captured_queries[0]["sql"].endswith(", false)")


def test_a_lost_claim_leaves_the_run_to_be_executed_again_from_its_journal(engine: Engine) -> None:
    """What a crash of the database right after an asynchronous claim leaves: the run as it
    was before the claim. The execution that began meanwhile journals nothing (its lease is
    gone), the run stays pending and counted, and the next execution completes it."""
    bodies: list[int] = []

    def body(ctx, input):
        return ctx.step("effect", lambda: bodies.append(len(bodies)) or len(bodies))

    def lose_the_claim(run_id: str) -> None:
        WorkflowRun.objects.filter(run_id=run_id).update(
            status=RunStatus.PENDING, lease="", worker="", attempt=F("attempt") - 1, heartbeat_at=None, started_at=None
        )
        WorkflowRun.objects.get(run_id=run_id).tags.update(status=RunStatus.PENDING)

    engine.register("effects", "1", body, Concurrency(key="k", limit=1))
    handle = engine.start("effects")
    original = engine.store.record_step

    def record_after_the_crash(run_id, lease, step):
        lose_the_claim(run_id)
        return original(run_id, lease, step)

    engine.store.record_step = record_after_the_crash  # type: ignore[method-assign]
    assert engine.executor.execute(handle.run_id) is False
    run = engine.store.get_run(handle.run_id)
    assert (run.status, run.attempt, engine.store.load_steps(handle.run_id)) == (RunStatus.PENDING, 0, [])
    assert engine.count_runs(tag="concurrency:k", statuses=["pending", "running"]) == 1  # its slot stays taken
    del engine.store.record_step
    assert engine.executor.execute(handle.run_id) is False
    run = engine.store.get_run(handle.run_id)
    assert (run.status, run.output, bodies) == (RunStatus.COMPLETED, 2, [0, 1])  # at least once, as after a worker's crash
