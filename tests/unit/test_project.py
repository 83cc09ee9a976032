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
        [error] = [m for m in checks.check_settings() if m.id == "durable.E001"]
    # The hint names the closest setting and a page of the published docs, not a file of the source tree.
    assert error.hint.startswith("Did you mean 'STALE_AFTER'? ") and '"Settings" page' in error.hint
    assert "docs/" not in error.hint


def test_stale_after_must_exceed_two_heartbeats() -> None:
    with override_settings(DURABLE={"HEARTBEAT_INTERVAL": 10, "STALE_AFTER": 15}):
        assert "durable.E002" in [m.id for m in checks.check_settings()]
    with override_settings(DURABLE={"HEARTBEAT_INTERVAL": 5, "STALE_AFTER": 30}):
        assert "durable.E002" not in [m.id for m in checks.check_settings()]


@pytest.mark.parametrize("name", ["TRACEBACK_LIMIT", "PROMETHEUS_ACTIVE_RUNS_KEYS"])
@pytest.mark.parametrize(("value", "bad"), [(0, False), (8192, False), (-1, True), ("8k", True), (True, True), (1.5, True)])
def test_count_settings_must_be_whole_numbers(name: str, value: object, bad: bool) -> None:
    with override_settings(DURABLE={name: value}):
        errors = [m for m in checks.check_settings() if m.id == "durable.E003"]
    assert len(errors) == int(bad)
    if bad:
        assert name in errors[0].msg and repr(value) in errors[0].msg


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


@pytest.fixture
def celery_app() -> Any:
    """A Celery app of its own as the current app (durable's shared tasks bind to it), then the test project's again."""
    from celery import Celery, current_app

    from durable.tasks import beat_schedule

    previous = current_app._get_current_object()
    app = Celery("checked", set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], beat_schedule=beat_schedule())
    app.set_current()
    yield app
    previous.set_current()


def check_ids() -> list[str]:
    return sorted(message.id for message in checks.check_celery())


def test_a_celery_app_set_up_as_the_docs_say_passes(celery_app: Any) -> None:
    assert check_ids() == []


@pytest.mark.parametrize(
    "config",
    [{"accept_content": ["json", "pickle"]}, {"task_serializer": "pickle", "accept_content": ["pickle"]}],
)
def test_a_celery_app_that_reads_pickle_is_warned(celery_app: Any, config: dict[str, Any]) -> None:
    celery_app.conf.update(config)
    [warning] = checks.check_celery()
    assert warning.id == "durable.W002" and "pickle" in warning.msg and "CELERY_ACCEPT_CONTENT" in warning.hint


def test_durable_tasks_annotated_not_to_ack_late_are_warned(celery_app: Any) -> None:
    celery_app.conf.task_annotations = {"durable.execute_run": {"acks_late": False}}
    warnings = checks.check_celery()
    assert [w.id for w in warnings] == ["durable.W003"]
    assert "'durable.execute_run'" in warnings[0].msg and "task_annotations" in warnings[0].hint


def test_a_beat_schedule_without_the_sweep_is_warned(celery_app: Any) -> None:
    celery_app.conf.beat_schedule = {"other": {"task": "proj.other", "schedule": 60.0}}
    [warning] = checks.check_celery()
    assert warning.id == "durable.W004" and "durable.tasks.beat_schedule()" in warning.hint


@pytest.mark.parametrize(
    ("value", "bad"),
    [(0, False), (0.005, False), (1, False), (-0.001, True), (1.5, True), ("5ms", True), (True, True), (float("nan"), True)],
)
def test_the_publish_batch_interval_must_be_seconds_from_0_to_1(value: object, bad: bool) -> None:
    with override_settings(DURABLE={"PUBLISH_BATCH_INTERVAL": value}):
        errors = [m for m in checks.check_settings() if m.id == "durable.E005"]
        used = conf.publish_batch_interval()
    assert len(errors) == int(bad)
    if bad:
        assert "PUBLISH_BATCH_INTERVAL" in errors[0].msg and repr(value) in errors[0].msg
        assert used == conf.Defaults.PUBLISH_BATCH_INTERVAL  # the publisher goes on with the default
    else:
        assert used == value


def test_the_publisher_reads_the_default_interval_when_durable_settings_are_malformed() -> None:
    with override_settings(DURABLE=5):  # not a dictionary: reading any setting raises TypeError
        assert conf.publish_batch_interval() == conf.Defaults.PUBLISH_BATCH_INTERVAL
