"""``DURABLE["RETENTION"]``: its validation, and the sweeper deleting one bounded batch
of expired finished runs per sweep (on both stores)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from durable import Concurrency, ConcurrencyLimitError, DjangoStore, Engine, RunStatus, checks, models, retention
from durable.stores import RunRecord
from durable.testing import StepRecordFactory, WorkflowRunFactory, tagged


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30d", 30 * 86400), ("12h", 12 * 3600), ("90m", 5400), ("45s", 45), (" 0s ", 0), ("36500d", 36500 * 86400)],
)
def test_durations(text: str, seconds: int) -> None:
    assert retention.parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["30x", "30", "d", "-1d", "1.5h", "3 days", "", None, 30, "36501d", "1d2h"])
def test_bad_durations(text: Any) -> None:
    with pytest.raises(ValueError, match="is not a duration|longer than"):
        retention.parse_duration(text)


def test_retention_policy_forms(settings: Any) -> None:
    assert retention.retention_policy() == {}
    settings.DURABLE = {"RETENTION": "7d"}
    assert retention.retention_policy() == dict.fromkeys(["completed", "cancelled", "failed", "dead"], timedelta(days=7))
    settings.DURABLE = {"RETENTION": {"completed": "1d", "failed": "90d", "dead": None}}
    assert retention.retention_policy() == {"completed": timedelta(days=1), "failed": timedelta(days=90)}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("30x", "'30x' is not a duration"),
        ({"running": "1d"}, "'running' is not a finished status"),
        ({"completed": 30}, "30 is not a duration"),
        (30, "must be None, a duration"),
    ],
)
def test_a_bad_retention_is_a_clear_error_and_a_system_check(settings: Any, value: Any, message: str) -> None:
    settings.DURABLE = {"RETENTION": value}
    with pytest.raises(ImproperlyConfigured, match=message):
        retention.retention_policy()
    errors = [e for e in checks.check_settings() if e.id == "durable.E004"]
    assert len(errors) == 1 and message in errors[0].msg


def _finished(engine: Engine, status: str, age: timedelta, **fields: Any) -> str:
    """A finished run, created through the store, that ended ``age`` ago."""
    run_id = f"{status}-{age.total_seconds():.0f}-{len(engine.list_runs())}"
    record = RunRecord(
        run_id=run_id,
        workflow="w",
        version="1",
        namespace="default",
        status=status,
        finished_at=timezone.now() - age,
        **fields,
    )
    with engine.store.admission([]):
        engine.store.create_run(record, [f"concurrency:{run_id}"])
    return run_id


@pytest.mark.django_db
def test_the_sweeper_deletes_expired_runs_in_a_bounded_batch(engine: Engine, settings: Any, monkeypatch: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "RETENTION": {"completed": "1d", "failed": "10d"}}
    monkeypatch.setattr(retention, "SWEEP_BATCH_SIZE", 2)
    old = [_finished(engine, "completed", timedelta(days=3 + i)) for i in range(3)]
    failed_recent = _finished(engine, "failed", timedelta(days=3))
    failed_old = _finished(engine, "failed", timedelta(days=11))
    cancelled_old = _finished(engine, "cancelled", timedelta(days=300))  # not in the policy: kept
    fresh = _finished(engine, "completed", timedelta(hours=1))

    first = engine.sweep()["purged"]
    assert first == [old[2], old[1]]  # oldest finished first, at most the batch
    second = engine.sweep()["purged"]
    assert second == [old[0], failed_old]
    assert engine.sweep()["purged"] == []
    left = {h.run_id for h in engine.list_runs()}
    assert left == {failed_recent, cancelled_old, fresh}


@pytest.mark.django_db
def test_the_sweeper_keeps_a_parent_whose_child_runs(engine: Engine, settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "RETENTION": "1d"}
    parent = _finished(engine, "failed", timedelta(days=3))
    with engine.store.admission([]):
        engine.store.create_run(
            RunRecord(run_id="child", workflow="w", version="1", namespace="default", status="running", parent_run_id=parent),
            [],
        )
    assert engine.sweep()["purged"] == []
    assert engine.store.get_run(parent) is not None


@pytest.mark.django_db
def test_without_retention_the_sweeper_deletes_nothing(engine: Engine) -> None:
    _finished(engine, "completed", timedelta(days=3000))
    assert engine.sweep()["purged"] == []
    assert len(engine.list_runs()) == 1


@pytest.mark.django_db
def test_a_failing_retention_does_not_stop_the_sweep(engine: Engine, settings: Any, monkeypatch: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "RETENTION": "1d"}

    def broken(*args: Any, **kwargs: Any) -> list[str]:
        raise RuntimeError("database on fire")

    monkeypatch.setattr(engine.store, "purge_finished", broken)
    result = engine.sweep()
    assert result["purged"] == [] and "woken" in result


@pytest.mark.django_db
def test_the_database_purge_deletes_the_rows_of_the_runs() -> None:
    run = WorkflowRunFactory(status="completed", finished_at=timezone.now() - timedelta(days=2))
    tagged(run, "concurrency:a", "b")
    StepRecordFactory(run=run)
    models.Signal.objects.create(run=run, name="s")
    kept = WorkflowRunFactory(status="completed", finished_at=timezone.now())
    tagged(kept, "concurrency:a")
    purged = DjangoStore().purge_finished({"completed": timezone.now() - timedelta(days=1)}, limit=10)
    assert purged == [run.run_id]
    assert not models.RunTag.objects.filter(run_id=run.pk).exists()
    assert not models.StepRecord.objects.filter(run_id=run.pk).exists()
    assert not models.Signal.objects.filter(run_id=run.pk).exists()
    assert list(models.RunTag.objects.values_list("run_id", flat=True)) == [kept.pk]


@pytest.mark.django_db
def test_a_batch_is_no_bigger_than_the_database_takes_parameters(monkeypatch: Any) -> None:
    from django.db import connection

    if connection.vendor == "postgresql":
        pytest.skip("one array parameter per statement on PostgreSQL")
    # On the class: Django 6.1 made it a property without a setter.
    monkeypatch.setattr(type(connection.features), "max_query_params", 3)
    for _ in range(5):
        WorkflowRunFactory(status="completed", finished_at=timezone.now() - timedelta(days=2))
    run_ids, cursor = retention.purge_batch("completed", timezone.now() - timedelta(days=1), limit=5000)
    assert len(run_ids) == 3 and cursor is not None
    assert retention.purge({"completed": timezone.now() - timedelta(days=1)}) == {"completed": 2}


@pytest.mark.django_db
def test_a_run_a_lifetime_cap_still_counts_is_kept(engine: Engine, settings: Any) -> None:
    """Deleting a completed run that its key counts (count_statuses with "completed")
    would hand the cap a slot back: the purge keeps it, and the cap stays full."""
    settings.DURABLE = {**settings.DURABLE, "RETENTION": "0s"}
    lifetime = Concurrency(key="cap:acme", limit=1, count_statuses=["pending", "running", "completed"])
    engine.register("retention.capped", "1", lambda ctx, input: None, lifetime)
    engine.register("retention.plain", "1", lambda ctx, input: None, Concurrency(key="plain:acme", limit=1))
    capped, plain = engine.start("retention.capped"), engine.start("retention.plain")
    engine.execute(capped.run_id)
    engine.execute(plain.run_id)

    assert engine.sweep()["purged"] == [plain.run_id]
    assert engine.get_run(capped.run_id).status == RunStatus.COMPLETED
    with pytest.raises(ConcurrencyLimitError):
        engine.start("retention.capped")
    assert engine.sweep()["purged"] == []
