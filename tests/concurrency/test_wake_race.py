"""A child ends while its parent is committing its suspension (PostgreSQL, real threads).

The parent's suspension locks its row, reads the child still running, and parks the
parent; until it commits, the parent's row reads ``running``. The child's wake-up must
wait for that commit: a compare-and-set whose condition (``suspended``) the row fails
in its snapshot does not wait for the row's lock holder, so it would find nothing to
wake and the parent would sleep until the sweeper found it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from durable import Engine, RunStatus
from durable.runtime import Registry
from tests.threads import held_open, started

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _claimed(engine: Engine, run_id: str, lease: str) -> Any:
    taken = engine.store.claim_journal(run_id, lease=lease, worker="test", stale_before=timezone.now() - timedelta(minutes=1))
    assert taken is not None
    return taken[0]


def _lock_waiters() -> int:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_a_child_ending_while_its_parent_commits_its_suspension_wakes_the_parent() -> None:
    registry = Registry()
    registry.register("parent", "1", lambda ctx, input: None)
    registry.register("child", "1", lambda ctx, input: None)
    sent: list[str] = []
    engine = Engine(dispatch=lambda engine, run: sent.append(run.run_id), registry=registry)
    parent = _claimed(engine, engine.start("parent", {}).run_id, "parent-lease")
    child = _claimed(engine, engine.start("child", {}, parent_run_id=parent.run_id).run_id, "child-lease")
    sent.clear()

    def suspend() -> bool:
        # The parent reads its child still running, and parks; held open: not committed yet.
        return engine.store.suspend(parent.run_id, "parent-lease", waiting_for=f"child:{child.run_id}", wake_at=None)

    with held_open(suspend) as suspending:
        ending = started(lambda: engine.executor.finish(child, "child-lease", RunStatus.COMPLETED, output=1))
        # The child's end commits, then its wake-up waits for the parent's row (or, without
        # the wait, is over at once, having found the parent running).
        deadline = time.monotonic() + 30
        while ending.is_alive() and _lock_waiters() == 0:
            assert time.monotonic() < deadline, "the child's end neither finished nor waited"
            time.sleep(0.01)
        assert engine.store.get_run(child.run_id).status == RunStatus.COMPLETED
    assert suspending.outcome() is True  # the parent parked: it read its child running
    assert ending.outcome() is True

    woken = engine.store.get_run(parent.run_id)
    assert (woken.status, woken.waiting_for) == (RunStatus.PENDING, "")
    assert sent == [parent.run_id]  # sent to a worker at once, not left to the sweeper
