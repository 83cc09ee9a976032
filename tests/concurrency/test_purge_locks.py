"""A purge batch holds no lock a start waits on, and leaves a run another
transaction holds (a retry under way) alone (PostgreSQL, threads on connections
of their own)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable import Concurrency, ConcurrencyLimitError, DjangoStore, Engine, models, retention
from durable.runtime import Dispatcher, Registry
from durable.status import RunStatus
from durable.stores import RunRecord
from durable.testing import WorkflowRunFactory, tagged
from tests.threads import held_open, started

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


class _NoDispatch(Dispatcher):
    def send(self, engine: Engine, run: RunRecord) -> None:
        pass

    def revoke(self, engine: Engine, run: RunRecord) -> None:
        pass


def _engine() -> Engine:
    engine = Engine(DjangoStore(), dispatch=_NoDispatch(), registry=Registry())
    engine.register("locks.start", "1", lambda ctx, input: None, concurrency=Concurrency(key=lambda i: i["key"], limit=2))
    return engine


def _old_run(key: str, status: str = RunStatus.COMPLETED) -> models.WorkflowRun:
    run = WorkflowRunFactory(status=status, finished_at=timezone.now() - timedelta(days=2))
    tagged(run, f"concurrency:{key}")
    return run


def test_starts_go_on_while_a_purge_batch_holds_its_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine()
    engine.start("locks.start", {"key": "busy"})
    engine.start("locks.start", {"key": "busy"})  # "busy" is full
    engine.start("locks.start", {"key": "free"})
    for key in ("busy", "free"):
        for _ in range(3):
            _old_run(key)
    deleted, release = threading.Event(), threading.Event()
    delete = retention._delete

    def delete_then_hold(using: str, ids: Any) -> None:
        delete(using, ids)
        deleted.set()  # the batch's rows are deleted, its transaction open
        assert release.wait(30)

    monkeypatch.setattr(retention, "_delete", delete_then_hold)
    purge = started(lambda: retention.purge_batch(RunStatus.COMPLETED, timezone.now() - timedelta(days=1), limit=100))
    try:
        assert deleted.wait(30)
        # While the purge holds the deleted runs, their tags and their lock: a start
        # on either key is decided at once (the purge never touches the lock rows).
        admitted = started(lambda: engine.start("locks.start", {"key": "free"}).run_id)
        refused = started(lambda: engine.start("locks.start", {"key": "busy"}))
        assert admitted.outcome(timeout=5)
        with pytest.raises(ConcurrencyLimitError):
            refused.outcome(timeout=5)
    finally:
        release.set()
    run_ids, _ = purge.outcome()
    assert len(run_ids) == 6
    assert models.WorkflowRun.objects.filter(status=RunStatus.PENDING).count() == 4


def test_a_purge_skips_a_run_another_transaction_holds() -> None:
    held = _old_run("k", RunStatus.FAILED)
    other = _old_run("k", RunStatus.FAILED)

    def lock_it() -> None:
        list(models.WorkflowRun.objects.select_for_update().filter(pk=held.pk))

    with held_open(lock_it):
        deleted = retention.purge({RunStatus.FAILED: timezone.now() - timedelta(days=1)}, batch_size=10)
    assert deleted == {RunStatus.FAILED: 1}
    assert list(models.WorkflowRun.objects.values_list("pk", flat=True)) == [held.pk]
    assert not models.WorkflowRun.objects.filter(pk=other.pk).exists()
    # The next purge takes it.
    assert retention.purge({RunStatus.FAILED: timezone.now() - timedelta(days=1)}) == {RunStatus.FAILED: 1}
