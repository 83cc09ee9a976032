"""Migrations in sync, system checks, settings."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections
from django.test import override_settings

from durable import checks, conf


@pytest.mark.django_db
def test_migrations_are_in_sync_with_the_models() -> None:
    out = StringIO()
    call_command("makemigrations", "durable", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


def test_sqlite_without_immediate_transactions_is_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    db = dict(connections.settings["default"])
    db.update(ENGINE="django.db.backends.sqlite3", OPTIONS={})
    monkeypatch.setitem(connections.settings, "default", db)
    [warning] = checks.check_sqlite_transaction_mode()
    assert warning.id == "durable.W001"
    db["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}
    assert checks.check_sqlite_transaction_mode() == []


def test_unknown_setting_is_an_error() -> None:
    with override_settings(DURABLE={"STALE_AFTR": 10}):
        ids = [m.id for m in checks.check_settings()]
    assert "durable.E001" in ids


def test_stale_after_must_exceed_two_heartbeats() -> None:
    with override_settings(DURABLE={"HEARTBEAT_INTERVAL": 10, "STALE_AFTER": 15}):
        assert "durable.E002" in [m.id for m in checks.check_settings()]
    with override_settings(DURABLE={"HEARTBEAT_INTERVAL": 5, "STALE_AFTER": 30}):
        assert "durable.E002" not in [m.id for m in checks.check_settings()]


def test_settings_read_through_to_django_settings() -> None:
    assert conf.settings.MAX_ATTEMPTS == 5
    with override_settings(DURABLE={"MAX_ATTEMPTS": 9}):
        assert conf.settings.MAX_ATTEMPTS == 9
    with pytest.raises(AttributeError, match="no setting 'NOPE'"):
        conf.settings.NOPE  # noqa: B018  (reading it is the test)


def test_beat_schedule_carries_the_sweep_interval(settings: Any) -> None:
    from durable.tasks import beat_schedule

    settings.DURABLE = {"SWEEP_INTERVAL": 7}
    assert beat_schedule() == {"durable-sweep": {"task": "durable.sweep", "schedule": 7.0}}


def test_run_tasks_are_json_and_acked_late() -> None:
    from durable.tasks import execute_run

    assert execute_run.acks_late and execute_run.reject_on_worker_lost
    assert execute_run.serializer == "json"
