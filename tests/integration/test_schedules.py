"""Persisted schedules: validation, the beat rows kept in step, windows, quotas, admin."""

from __future__ import annotations

import ast
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.contrib.messages import get_messages
from django.db import models as django_models
from django.http import HttpResponse
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask, PeriodicTasks

from durable import Concurrency, Strategy, engine, exceptions, models, schedules, tasks
from durable.admin.schedules import ScheduleForm
from durable.schedules import Outcome
from durable.status import RunStatus
from durable.testing import wait_for
from tests.threads import started

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES_URL = reverse("admin:durable_schedule_changelist")
PARIS = ZoneInfo("Europe/Paris")


def make(name: str = "digest", **options: Any) -> models.Schedule:
    """A schedule of ``test.add`` (its own quota: 3 runs per input["key"]), every minute by default."""
    options.setdefault("input", {"a": 1, "b": 2})
    if "cron" not in options:
        options.setdefault("every", 60)
    return schedules.create_schedule(name, options.pop("workflow", "test.add"), options.pop("input"), **options)


def fill(key: str, n: int = 1) -> list[str]:
    """Put ``n`` pending runs on concurrency key ``key`` (they are never executed here)."""
    return [engine.start("test.fatal", None, concurrency=Concurrency(key=key, limit=n)).run_id for _ in range(n)]


def beat_rows() -> tuple[int, int, int, int]:
    return (
        models.Schedule.objects.count(),
        PeriodicTask.objects.count(),
        CrontabSchedule.objects.count(),
        IntervalSchedule.objects.count(),
    )


# -- validation: each bad setting is refused with a clear message, nothing written ----------


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"workflow": "no.such"}, "workflow", "No workflow is registered under the name 'no.such'"),
        ({"workflow": ""}, "workflow", "Give the name of a registered workflow"),
        ({"cron": "61 * * * *"}, "cron", "Invalid cron expression '61 * * * *'"),
        ({"cron": "not a cron"}, "cron", "it has 3 fields, not 5"),
        ({"cron": "0 9 * * * *"}, "cron", "it has 6 fields, not 5"),
        ({"cron": "@daily"}, "cron", "it has 1 fields, not 5"),
        ({"cron": "0 9 L * *"}, "cron", "Invalid cron expression '0 9 L * *'"),
        ({"cron": "0 0 30 2 *"}, "cron", "never fires"),
        ({"cron": "0 9 * * *", "every": 60}, "cron", "not both"),
        ({"cron": "0 9 * * *", "every": 60}, "interval_seconds", "not both"),
        ({"every": None}, "cron", "needs one of them"),
        ({"every": 0}, "interval_seconds", "from 1 to"),
        ({"every": -5}, "interval_seconds", "from 1 to"),
        ({"every": 1.5}, "interval_seconds", "whole number of seconds"),
        ({"every": True}, "interval_seconds", "whole number of seconds"),
        ({"every": 2**31}, "interval_seconds", "from 1 to 2147483647"),
        ({"every": 1}, "interval_seconds", "at least 60 seconds (SCHEDULE_MIN_INTERVAL)"),
        ({"every": 59}, "interval_seconds", "at least 60 seconds (SCHEDULE_MIN_INTERVAL)"),
        ({"cron": "0 9 * * *", "timezone": "Mars/Olympus"}, "timezone", "Unknown timezone 'Mars/Olympus'"),
        ({"timezone": ""}, "timezone", "Unknown timezone"),
        ({"concurrency_key": "sched:k"}, "concurrency_limit", "needs a limit"),
        ({"concurrency_key": "sched:k", "concurrency_limit": "3"}, "concurrency_limit", "must be an integer"),
        ({"concurrency_key": "sched:k", "concurrency_limit": 2.5}, "concurrency_limit", "must be an integer"),
        ({"concurrency_key": "sched:k", "concurrency_limit": True}, "concurrency_limit", "must be an integer"),
        ({"concurrency_key": "sched:k", "concurrency_limit": -1}, "concurrency_limit", "from 0 to"),
        ({"concurrency_limit": 3}, "concurrency_key", "needs a concurrency key"),
        ({"concurrency_key": "k" * 201, "concurrency_limit": 3}, "concurrency_key", "at most 200 characters"),
        ({"input": {"when": datetime(2026, 1, 1)}}, "input", "must be a JSON value"),
        ({"input": {"x": float("nan")}}, "input", "must be a JSON value"),
        ({"input": "nul \x00"}, "input", "without NUL"),
        # test.add's own quota reads input["key"] with .get(); chat.turn's needs input["tenant_id"].
        ({"workflow": "chat.turn", "input": {"message": "hi"}}, "input", "own quota cannot be computed"),
        ({"namespace": ""}, "namespace", "1 to 100 characters"),
        ({"enabled": "yes"}, "enabled", "true or false"),
    ],
)
def test_each_bad_setting_is_refused_and_nothing_is_written(options: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(exceptions.InvalidScheduleError) as caught:
        make(**options)
    assert field in caught.value.errors
    assert any(message in m for m in caught.value.errors[field]), caught.value.errors
    assert message in str(caught.value)
    assert isinstance(caught.value, ValueError) and caught.value.code == "invalid_schedule"
    assert beat_rows() == (0, 0, 0, 0)


@pytest.mark.parametrize("name", ["", "has space", "a/b", "a:b", "x" * 184, "nul\x00"])
def test_a_bad_name_is_refused(name: str) -> None:
    with pytest.raises(exceptions.InvalidScheduleError, match="A schedule name must be 1 to 183"):
        make(name)
    assert beat_rows() == (0, 0, 0, 0)


def test_every_error_is_reported_at_once() -> None:
    with pytest.raises(exceptions.InvalidScheduleError) as caught:
        make("bad name", workflow="no.such", cron="61 * * * *", every=None, timezone="Nowhere", concurrency_key="k")
    assert set(caught.value.errors) == {"name", "workflow", "cron", "timezone", "concurrency_limit"}


def test_a_taken_name_is_refused() -> None:
    make("digest")
    with pytest.raises(exceptions.InvalidScheduleError, match="The schedule name 'digest' is taken"):
        make("digest", every=120)
    assert models.Schedule.objects.get().interval_seconds == 60
    assert PeriodicTask.objects.count() == 1


def test_the_minimum_interval_is_a_setting(settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "SCHEDULE_MIN_INTERVAL": 1}
    assert make("fast", every=1).interval_seconds == 1  # a trusted deployment may allow 1 s
    settings.DURABLE = {**settings.DURABLE, "SCHEDULE_MIN_INTERVAL": 7200}
    with pytest.raises(exceptions.InvalidScheduleError, match=r"at least 7200 seconds \(SCHEDULE_MIN_INTERVAL\)"):
        make("hourly", every=3600)
    # An existing schedule keeps firing (and can be paused), but any change must bring it within the minimum.
    assert schedules.fire(schedules.get_schedule("fast").pk).started  # type: ignore[union-attr]
    assert not schedules.pause("fast").enabled
    with pytest.raises(exceptions.InvalidScheduleError, match="SCHEDULE_MIN_INTERVAL"):
        schedules.update_schedule("fast", input={"a": 2, "b": 2})
    assert schedules.update_schedule("fast", every=7200, input={"a": 2, "b": 2}).interval_seconds == 7200


@pytest.mark.parametrize(
    ("cron", "shortest"),
    [
        ("* * * * *", "1 minute"),
        ("*/30 * * * *", "30 minutes"),
        ("0,1 9 * * *", "1 minute"),
        ("0 0,23 * * *", "1 hour"),  # 23:00, then 00:00 the next day
        ("0 */1 * * *", "1 hour"),
    ],
)
def test_a_cron_schedule_firing_more_often_than_the_minimum_is_refused(settings: Any, cron: str, shortest: str) -> None:
    settings.DURABLE = {**settings.DURABLE, "SCHEDULE_MIN_INTERVAL": 7200}
    with pytest.raises(exceptions.InvalidScheduleError) as caught:
        make("often", cron=cron)
    message = caught.value.errors["cron"][0]
    assert f"fires {shortest} after" in message and "SCHEDULE_MIN_INTERVAL" in message
    assert beat_rows() == (0, 0, 0, 0)


@pytest.mark.parametrize("cron", ["0 */2 * * *", "0 9 * * *", "0 0,23 * * 1", "0 9,12 * * 1-5"])
def test_a_cron_schedule_within_the_minimum_is_accepted(settings: Any, cron: str) -> None:
    # Monday 00:00 and 23:00 are 23 hours apart, and the next firing is a week later.
    settings.DURABLE = {**settings.DURABLE, "SCHEDULE_MIN_INTERVAL": 7200}
    assert make("often", cron=cron).cron == cron


def test_a_bad_update_changes_nothing() -> None:
    schedule = make("digest", cron="0 9 * * *", timezone="Europe/Paris")
    before = PeriodicTask.objects.get().date_changed
    with pytest.raises(exceptions.InvalidScheduleError, match="Invalid cron expression"):
        schedules.update_schedule(schedule, cron="0 25 * * *", input={"a": 5, "b": 5})
    schedule.refresh_from_db()
    assert (schedule.cron, schedule.input) == ("0 9 * * *", {"a": 1, "b": 2})
    assert PeriodicTask.objects.get().date_changed == before


def test_the_admin_form_gives_the_same_messages_per_field() -> None:
    form = ScheduleForm(data=form_data(name="x", workflow="no.such", cron="61 * * * *", input="{}"))
    assert not form.is_valid()
    errors = form.errors
    assert "No workflow is registered under the name 'no.such'" in errors["workflow"][0]
    assert "Invalid cron expression '61 * * * *'" in errors["cron"][0]
    # The database constraints are not reported a second time in their own words.
    assert not any("Constraint" in m for messages in errors.values() for m in messages)
    valid = ScheduleForm(data=form_data(name="x", input="{}", interval_seconds="300"))
    assert valid.is_valid(), valid.errors
    too_often = ScheduleForm(data=form_data(name="x", input="{}", interval_seconds="5"))
    assert not too_often.is_valid()
    assert "SCHEDULE_MIN_INTERVAL" in too_often.errors["interval_seconds"][0]
    assert models.Schedule.objects.count() == 0  # validating saves nothing


def test_the_model_does_not_validate_through_the_service() -> None:
    """models.py calls no service: Schedule has no clean() of its own (the admin form validates)."""
    assert models.Schedule.clean is django_models.Model.clean
    tree = ast.parse((ROOT / "durable" / "models.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("schedules" in name for name in imported)


def test_unknown_schedules_are_not_found() -> None:
    for call in (schedules.pause, schedules.resume, schedules.delete_schedule, schedules.run_now, schedules.get_schedule):
        with pytest.raises(exceptions.ScheduleNotFound, match="No schedule is named 'ghost'"):
            call("ghost")
    with pytest.raises(exceptions.ScheduleNotFound):
        schedules.update_schedule("ghost", every=5)


# -- the PeriodicTask row follows the schedule ----------------------------------------------


def test_a_cron_schedule_gets_its_periodic_task() -> None:
    schedule = make("digest", cron="30 9 * * 1-5", timezone="Europe/Paris")
    task = PeriodicTask.objects.get()
    assert schedule.periodic_task_id == task.pk
    assert task.name == "durable-schedule:digest"
    assert task.task == tasks.FIRE_SCHEDULE_TASK == "durable.fire_schedule"
    assert json.loads(task.args) == [schedule.pk] and json.loads(task.kwargs) == {}
    assert task.enabled and task.interval is None and task.queue is None
    crontab = task.crontab
    assert (crontab.minute, crontab.hour, crontab.day_of_month, crontab.month_of_year, crontab.day_of_week) == (
        "30",
        "9",
        "*",
        "*",
        "1-5",
    )
    assert str(crontab.timezone) == "Europe/Paris"
    assert PeriodicTasks.last_change() is not None  # beat is told


def test_an_interval_schedule_gets_its_periodic_task_on_the_task_queue(settings: Any) -> None:
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": "durable-runs"}
    make("tick", every=90)
    task = PeriodicTask.objects.get()
    assert task.crontab is None
    assert (task.interval.every, task.interval.period) == (90, IntervalSchedule.SECONDS)
    assert task.queue == "durable-runs"


def test_updates_pause_resume_and_delete_keep_the_periodic_task_in_step() -> None:
    schedule = make("digest", cron="0 9 * * *")
    task_pk = PeriodicTask.objects.get().pk
    changed = PeriodicTasks.last_change()

    schedules.update_schedule("digest", every=300)  # an interval replaces the cron
    task = PeriodicTask.objects.get()
    assert task.pk == task_pk and task.crontab is None and task.interval.every == 300
    assert PeriodicTasks.last_change() > changed

    schedules.update_schedule(schedule, cron="15 7 * * *", timezone="Asia/Tokyo")  # and back
    task = PeriodicTask.objects.get()
    assert task.interval is None and (task.crontab.minute, task.crontab.hour) == ("15", "7")
    assert str(task.crontab.timezone) == "Asia/Tokyo"
    assert models.Schedule.objects.get().interval_seconds is None

    changed = PeriodicTasks.last_change()
    assert not schedules.pause("digest").enabled
    assert not PeriodicTask.objects.get().enabled and not models.Schedule.objects.get().enabled
    assert PeriodicTasks.last_change() > changed
    assert schedules.resume("digest").enabled
    assert PeriodicTask.objects.get().enabled

    run_id = schedules.run_now("digest").run_id
    schedules.delete_schedule("digest")
    assert (models.Schedule.objects.count(), PeriodicTask.objects.count()) == (0, 0)
    assert models.WorkflowRun.objects.filter(run_id=run_id).exists()  # its runs are kept


def test_a_deleted_periodic_task_is_recreated_by_the_next_change() -> None:
    make("digest")
    PeriodicTask.objects.all().delete()  # someone deleted it in django-celery-beat's admin
    assert models.Schedule.objects.get().periodic_task is None
    schedules.resume("digest")
    assert PeriodicTask.objects.get().name == "durable-schedule:digest"
    assert models.Schedule.objects.get().periodic_task == PeriodicTask.objects.get()


def test_only_durable_schedules_beat_writes_django_celery_beat_rows() -> None:
    """No other module of durable imports django_celery_beat (models.py names the
    PeriodicTask table for its foreign key only, as a string)."""
    importers = []
    for path in sorted((ROOT / "durable").rglob("*.py")):
        if "migrations" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            if any(m.split(".")[0] == "django_celery_beat" for m in modules):
                importers.append(path.relative_to(ROOT).as_posix())
    assert importers == ["durable/schedules/beat.py"]


def test_beat_rows_send_the_fire_schedule_task() -> None:
    """beat.py writes the task's name without importing durable.tasks (which imports schedules)."""
    assert schedules.FIRE_SCHEDULE_TASK == tasks.FIRE_SCHEDULE_TASK == tasks.fire_schedule.name
    make("digest")
    assert PeriodicTask.objects.get().task == tasks.FIRE_SCHEDULE_TASK


# -- windows and deterministic run ids -----------------------------------------------------


def test_a_cron_window_is_the_latest_tick_in_the_schedules_timezone() -> None:
    schedule = make("digest", cron="0 9 * * *", timezone="Europe/Paris")
    at_tick = datetime(2026, 3, 10, 9, 0, tzinfo=PARIS)
    assert schedules.window_of(schedule, at_tick) == datetime(2026, 3, 10, 8, 0, tzinfo=UTC)
    assert schedules.window_of(schedule, at_tick + timedelta(hours=5)) == datetime(2026, 3, 10, 8, 0, tzinfo=UTC)
    assert schedules.window_of(schedule, at_tick - timedelta(seconds=1)) == datetime(2026, 3, 9, 8, 0, tzinfo=UTC)
    # Summer time: 09:00 in Paris is 07:00 UTC.
    assert schedules.window_of(schedule, datetime(2026, 7, 1, 12, tzinfo=PARIS)) == datetime(2026, 7, 1, 7, tzinfo=UTC)


def test_cron_day_of_month_and_day_of_week_both_apply_as_in_beat() -> None:
    schedule = make("digest", cron="0 9 13 * 5")  # Friday the 13th, 09:00 UTC
    assert schedules.window_of(schedule, datetime(2026, 12, 1, tzinfo=UTC)) == datetime(2026, 11, 13, 9, tzinfo=UTC)


def windows(schedule: models.Schedule, start: datetime, end: datetime) -> list[datetime]:
    """The distinct windows of ``schedule`` seen minute by minute from ``start`` to ``end``, in order."""
    seen: list[datetime] = []
    moment = start
    while moment <= end:
        window = schedules.window_of(schedule, moment)
        assert window <= moment
        assert not seen or window >= seen[-1], f"the window went back in time at {moment}"
        if not seen or window != seen[-1]:
            seen.append(window)
        moment += timedelta(minutes=1)
    return seen


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def test_a_wall_clock_time_that_occurs_twice_fires_once_at_its_first_occurrence() -> None:
    # Paris falls back on 2026-10-25: 03:00 CEST (01:00Z) becomes 02:00 CET, so
    # 02:30 happens at 00:30Z and again at 01:30Z.
    schedule = make("night", cron="30 2 * * *", timezone="Europe/Paris")
    assert windows(schedule, utc(2026, 10, 24, 22), utc(2026, 10, 25, 4)) == [
        utc(2026, 10, 24, 0, 30),  # yesterday's
        utc(2026, 10, 25, 0, 30),  # 02:30 CEST, the first 02:30
    ]
    first = schedules.fire(schedule.pk, now=utc(2026, 10, 25, 0, 30, 5))
    again = schedules.fire(schedule.pk, now=utc(2026, 10, 25, 1, 30, 5))  # beat firing at the second 02:30
    assert first is not None and first.outcome is Outcome.STARTED
    assert again is not None and again.outcome is Outcome.ALREADY_STARTED and again.run_id == first.run_id
    assert first.run_id == "schedule:night:2026-10-25T00:30:00Z"
    assert models.WorkflowRun.objects.count() == 1


def test_a_wall_clock_time_that_does_not_exist_fires_once_shifted_by_the_gap() -> None:
    # Paris springs forward on 2026-03-29: 02:00 CET (01:00Z) becomes 03:00 CEST, so
    # there is no 02:30; it fires once, an hour later on the clock: 03:30 CEST (01:30Z).
    schedule = make("night", cron="30 2 * * *", timezone="Europe/Paris")
    assert windows(schedule, utc(2026, 3, 28, 22), utc(2026, 3, 29, 6)) == [
        utc(2026, 3, 28, 1, 30),
        utc(2026, 3, 29, 1, 30),
    ]
    assert schedules.window_of(schedule, utc(2026, 3, 29, 1, 10)) == utc(2026, 3, 28, 1, 30)  # 03:10 CEST


@pytest.mark.parametrize(
    ("cron", "start", "expected"),
    [
        # Hourly on the fall-back night: 02:00 happens once (00:00Z); the repeated hour adds no window.
        (
            "0 * * * *",
            utc(2026, 10, 24, 22),
            [utc(2026, 10, 24, 22), utc(2026, 10, 24, 23), utc(2026, 10, 25, 0), utc(2026, 10, 25, 2)],
        ),
        # Every 30 minutes: 02:00 and 02:30 CEST, then 03:00 CET (02:00Z).
        (
            "*/30 * * * *",
            utc(2026, 10, 24, 23, 30),
            [
                utc(2026, 10, 24, 23, 30),
                utc(2026, 10, 25, 0),
                utc(2026, 10, 25, 0, 30),
                utc(2026, 10, 25, 2),
                utc(2026, 10, 25, 2, 30),
                utc(2026, 10, 25, 3),
                utc(2026, 10, 25, 3, 30),
                utc(2026, 10, 25, 4),
            ],
        ),
        # Hourly on the spring-forward night: the missing 02:00 is 03:00 CEST, one window.
        (
            "0 * * * *",
            utc(2026, 3, 28, 23),
            [utc(2026, 3, 28, 23), utc(2026, 3, 29, 0), utc(2026, 3, 29, 1), utc(2026, 3, 29, 2), utc(2026, 3, 29, 3)],
        ),
        # 02:45 does not exist: shifted to 03:45 CEST (01:45Z), after 03:00 CEST (01:00Z).
        ("45 2 * * *", utc(2026, 3, 28, 22), [utc(2026, 3, 28, 1, 45), utc(2026, 3, 29, 1, 45)]),
        ("0,45 2,3 * * *", utc(2026, 3, 28, 23), [utc(2026, 3, 28, 2, 45), utc(2026, 3, 29, 1), utc(2026, 3, 29, 1, 45)]),
    ],
)
def test_windows_across_both_daylight_saving_changes(cron: str, start: datetime, expected: list[datetime]) -> None:
    schedule = make("dst", cron=cron, timezone="Europe/Paris")
    assert windows(schedule, start, start + timedelta(hours=4, minutes=30)) == expected


def test_an_interval_window_is_the_time_rounded_down_to_the_interval() -> None:
    schedule = make("tick", every=60)
    now = datetime(2026, 11, 30, 12, 34, 56, 789000, tzinfo=UTC)
    assert schedules.window_of(schedule, now) == datetime(2026, 11, 30, 12, 34, tzinfo=UTC)
    schedules.update_schedule(schedule, every=3600)
    schedule.refresh_from_db()
    assert schedules.window_of(schedule, now) == datetime(2026, 11, 30, 12, tzinfo=UTC)


def test_a_window_starts_a_run_with_the_deterministic_id() -> None:
    schedule = make("digest", cron="0 9 * * *", timezone="Europe/Paris", input={"a": 2, "b": 3}, namespace="eu")
    firing = schedules.fire(schedule.pk, now=datetime(2026, 3, 10, 9, 0, 20, tzinfo=PARIS))
    assert firing is not None and firing.outcome is Outcome.STARTED and firing.started
    assert firing.run_id == "schedule:digest:2026-03-10T08:00:00Z"
    run = models.WorkflowRun.objects.get()
    assert (run.run_id, run.workflow, run.input, run.namespace, run.status) == (
        firing.run_id,
        "test.add",
        {"a": 2, "b": 3},
        "eu",
        RunStatus.PENDING,
    )
    schedule.refresh_from_db()
    assert schedule.last_run_id == firing.run_id and schedule.last_run_at is not None
    assert schedule.last_error == ""


def test_a_null_input_is_stored_and_given_to_each_run() -> None:
    schedule = schedules.create_schedule("nulls", "test.fatal", None, every=300)
    schedules.update_schedule(schedule, every=600)  # and kept by an update
    schedule.refresh_from_db()
    assert schedule.input is None and schedule.interval_seconds == 600
    firing = schedules.fire(schedule.pk)
    assert firing is not None and firing.started and firing.handle is not None
    assert firing.handle.input is None


def test_the_longest_name_gives_a_run_id_that_fits() -> None:
    name = "n" * schedules.MAX_NAME_LENGTH
    schedule = make(name)
    assert len(schedules.manual_run_id(name, datetime.now(UTC))) <= 255
    assert schedules.fire(schedule.pk).started  # type: ignore[union-attr]
    assert schedules.run_now(name).started


def test_a_beat_double_fire_starts_exactly_one_run() -> None:
    schedule = make("tick", every=60)
    now = datetime(2026, 11, 30, 12, 0, 5, tzinfo=UTC)
    first = schedules.fire(schedule.pk, now=now)
    second = schedules.fire(schedule.pk, now=now + timedelta(seconds=30))  # same window
    assert first is not None and second is not None
    assert (first.outcome, second.outcome) == (Outcome.STARTED, Outcome.ALREADY_STARTED)
    assert first.run_id == second.run_id
    assert models.WorkflowRun.objects.count() == 1
    third = schedules.fire(schedule.pk, now=now + timedelta(seconds=60))  # the next window
    assert third is not None and third.started and third.run_id != first.run_id
    assert models.WorkflowRun.objects.count() == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_duplicate_fire_racing_the_first_reports_the_started_window() -> None:
    """Two fires of each window at once (threads with their own connections), limit 1:
    one starts the run, the other reports it already started, never a skipped window."""
    schedule = make("race", every=60, concurrency_key="sched:race", concurrency_limit=1)
    base = datetime(2026, 11, 30, 12, 0, 5, tzinfo=UTC)
    outcomes: list[tuple[int, Outcome]] = []
    barrier = threading.Barrier(2)

    def fire(window: int) -> None:
        barrier.wait(timeout=30)
        firing = schedules.fire(schedule.pk, now=base + timedelta(minutes=window))
        assert firing is not None
        outcomes.append((window, firing.outcome))

    for window in range(10):
        for thread in [started(lambda window=window: fire(window)) for _ in range(2)]:
            thread.outcome()
        # The window's run finishes: the next window has room.
        run_id = schedules.window_run_id("race", schedules.window_of(schedule, base + timedelta(minutes=window)))
        # (A worker another test left running in this process may be executing it.)
        if not engine.store.transition(run_id, from_statuses=["pending", "running"], to="completed"):
            assert engine.get_run(run_id).status == "completed"
        schedule.refresh_from_db()
        assert schedule.last_error == "", f"window {window}: {schedule.last_error}"
    for window in range(10):
        assert sorted(o.value for w, o in outcomes if w == window) == sorted(
            [Outcome.STARTED.value, Outcome.ALREADY_STARTED.value]
        ), f"window {window}"
    assert models.WorkflowRun.objects.count() == 10


def test_a_paused_or_deleted_schedule_starts_nothing() -> None:
    schedule = make("tick")
    schedules.pause(schedule)
    firing = schedules.fire(schedule.pk)
    assert firing is not None and firing.outcome is Outcome.PAUSED
    schedules.delete_schedule(schedule)
    assert schedules.fire(schedule.pk) is None
    assert models.WorkflowRun.objects.count() == 0


# -- the schedule's own quota --------------------------------------------------------------


def test_an_over_limit_window_is_skipped_and_written_to_last_error(admin_client: Client, caplog: Any) -> None:
    schedule = make("digest", cron="0 9 * * *", concurrency_key="sched:digest", concurrency_limit=2)
    blockers = fill("sched:digest", 2)
    runs_before = models.WorkflowRun.objects.count()

    firing = schedules.fire(schedule.pk, now=datetime(2026, 3, 10, 9, 1, tzinfo=UTC))

    assert firing is not None and firing.outcome is Outcome.SKIPPED and firing.handle is None
    assert models.WorkflowRun.objects.count() == runs_before  # no run created
    assert not models.WorkflowRun.objects.filter(run_id=firing.run_id).exists()
    schedule.refresh_from_db()
    assert schedule.last_error == firing.error
    for part in ("2026-03-10T09:00:00Z", "'sched:digest'", "2 of 2 runs in flight", "skipped"):
        assert part in schedule.last_error
    assert schedule.last_error_at is not None and schedule.last_run_id == ""
    assert "skipped" in caplog.text and any(r.levelname == "WARNING" for r in caplog.records)

    page = admin_client.get(SCHEDULES_URL)
    assert page.status_code == 200
    assert "2 of 2 runs in flight" in page.content.decode()

    # A slot frees; the next window starts and clears the error.
    engine.cancel(blockers[0])
    firing = schedules.fire(schedule.pk, now=datetime(2026, 3, 11, 9, 1, tzinfo=UTC))
    assert firing is not None and firing.started
    schedule.refresh_from_db()
    assert (schedule.last_error, schedule.last_error_at) == ("", None)
    assert schedule.last_run_id == "schedule:digest:2026-03-11T09:00:00Z"
    assert "2 of 2" not in admin_client.get(SCHEDULES_URL).content.decode()


def test_a_limit_of_zero_skips_every_window() -> None:
    schedule = make("never", concurrency_key="sched:never", concurrency_limit=0)
    firing = schedules.fire(schedule.pk)
    assert firing is not None and firing.outcome is Outcome.SKIPPED
    assert "0 of 0 runs in flight" in firing.error


def test_the_schedules_quota_replaces_the_workflows() -> None:
    # test.add allows 3 runs per input["key"]: fill key "wk".
    for _ in range(3):
        engine.start("test.add", {"key": "wk", "a": 1, "b": 1})
    own = make("own", input={"key": "wk", "a": 1, "b": 2}, concurrency_key="sched:own", concurrency_limit=5)
    plain = make("plain", input={"key": "wk", "a": 1, "b": 2})

    started = schedules.fire(own.pk)
    assert started is not None and started.started  # the workflow's full key is not counted
    tags = list(models.RunTag.objects.filter(run__run_id=started.run_id).values_list("tag", flat=True))
    assert tags == ["concurrency:sched:own"]

    skipped = schedules.fire(plain.pk)  # without a key of its own: the workflow's quota
    assert skipped is not None and skipped.outcome is Outcome.SKIPPED
    assert "'wk'" in skipped.error and "3 of 3" in skipped.error


def test_the_schedules_key_is_shared_with_other_starts() -> None:
    """The key is global (rule 3): runs started elsewhere with it fill the schedule's quota."""
    schedule = make("digest", concurrency_key="tenant:acme", concurrency_limit=1)
    engine.start("test.add", {"a": 1, "b": 1}, concurrency=Concurrency(key="tenant:acme", limit=8))
    firing = schedules.fire(schedule.pk)
    assert firing is not None and firing.outcome is Outcome.SKIPPED


@pytest.fixture
def strategy_workflows() -> Iterator[None]:
    """Two workflows of one run per input["key"]: queued beyond it, or created cancelled."""

    def body(ctx: Any, input: Any) -> Any:
        return input

    key = lambda input: input["key"]  # noqa: E731
    engine.register("sched.queued", "1", body, Concurrency(key=key, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN, max_queued=1))
    engine.register("sched.newest", "1", body, Concurrency(key=key, limit=1, strategy=Strategy.CANCEL_NEWEST))
    yield
    engine.registry.unregister("sched.queued")
    engine.registry.unregister("sched.newest")


def test_workflow_strategies_apply_to_a_schedule_without_its_own_key(strategy_workflows: None) -> None:
    queued = make("queued", workflow="sched.queued", input={"key": "q"})
    newest = make("newest", workflow="sched.newest", input={"key": "n"})
    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    for schedule in (queued, newest):
        assert schedules.fire(schedule.pk, now=now).started  # type: ignore[union-attr]

    waiting = schedules.fire(queued.pk, now=now + timedelta(minutes=1))  # GROUP_ROUND_ROBIN: queued, not skipped
    assert waiting is not None and waiting.started and waiting.handle is not None
    assert waiting.handle.status == RunStatus.QUEUED
    full = schedules.fire(queued.pk, now=now + timedelta(minutes=2))  # max_queued=1: the queue is full
    assert full is not None and full.outcome is Outcome.SKIPPED
    assert "the queue of concurrency key 'q' is full (1 runs wait, max_queued=1)" in full.error

    cancelled = schedules.fire(newest.pk, now=now + timedelta(minutes=1))  # CANCEL_NEWEST: created cancelled
    assert cancelled is not None and cancelled.outcome is Outcome.SKIPPED
    assert cancelled.handle is not None and cancelled.handle.status == RunStatus.CANCELLED
    assert "created cancelled (CANCEL_NEWEST)" in models.Schedule.objects.get(name="newest").last_error


def test_an_update_keeps_the_last_window_fields() -> None:
    schedule = make("digest", concurrency_key="sched:keep", concurrency_limit=0)
    schedules.fire(schedule.pk)
    schedules.update_schedule("digest", every=120, concurrency_limit=1)
    schedule.refresh_from_db()
    assert "skipped" in schedule.last_error and schedule.last_error_at is not None


def test_run_now_uses_a_manual_run_id_and_obeys_the_quota() -> None:
    schedule = make("digest", every=3600, concurrency_key="sched:now", concurrency_limit=1)
    now = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
    first = schedules.run_now(schedule, now=now)
    assert first.started and first.run_id == "schedule:digest:manual:2026-11-30T12:00:00.123456Z"
    assert first.run_id != schedules.window_run_id("digest", schedules.window_of(schedule, now))
    refused = schedules.run_now("digest", now=now + timedelta(seconds=1))
    assert refused.outcome is Outcome.SKIPPED and "Manual run" in refused.error
    assert models.Schedule.objects.get().last_error == refused.error
    assert models.WorkflowRun.objects.count() == 1
    schedules.pause(schedule)
    engine.cancel(first.run_id)
    assert schedules.run_now("digest").started  # a paused schedule can still be run by hand


def test_a_workflow_unregistered_after_saving_is_recorded_as_an_error() -> None:
    schedule = make("digest")
    models.Schedule.objects.filter(pk=schedule.pk).update(workflow="gone.away")
    firing = schedules.fire(schedule.pk)
    assert firing is not None and firing.outcome is Outcome.FAILED
    assert "gone.away" in models.Schedule.objects.get().last_error


# -- through Celery ----------------------------------------------------------------------------


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_the_fire_task_starts_the_window_and_the_run_completes(celery_worker: Any) -> None:
    schedule = make("via-task", every=3600, input={"a": 20, "b": 22})
    tasks.fire_schedule.apply_async(args=[schedule.pk], serializer="json")
    run = wait_for(
        lambda: models.WorkflowRun.objects.filter(run_id__startswith="schedule:via-task:", status="completed").first(),
        timeout=20,
        what="the scheduled run to complete",
    )
    assert run.output == {"total": 42}
    expected = schedules.window_run_id("via-task", schedules.window_of(schedule, run.created_at))
    assert run.run_id == expected
    assert models.Schedule.objects.get().last_run_id == run.run_id


# -- admin ----------------------------------------------------------------------------------


def change_url(schedule: models.Schedule) -> str:
    return reverse("admin:durable_schedule_change", args=[schedule.pk])


def messages_of(response: HttpResponse) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def form_data(**fields: Any) -> dict[str, Any]:
    data = {
        "name": "digest",
        "workflow": "test.add",
        "input": '{"a": 1, "b": 2}',
        "namespace": "default",
        "enabled": "on",
        "cron": "",
        "interval_seconds": "",
        "timezone": "UTC",
        "concurrency_key": "",
        "concurrency_limit": "",
    }
    data.update(fields)
    return {k: v for k, v in data.items() if v is not None}


def test_admin_changelist_shows_each_schedule(admin_client: Client) -> None:
    make("digest", cron="0 9 * * *", timezone="Europe/Paris", concurrency_key="tenant:acme", concurrency_limit=8)
    make("tick", every=90)
    response = admin_client.get(SCHEDULES_URL)
    assert response.status_code == 200
    page = response.content.decode()
    assert [s.name for s in response.context["cl"].result_list] == ["digest", "tick"]
    for text in ("cron 0 9 * * *", "Europe/Paris", "every 90s", "tenant:acme (limit 8)"):
        assert text in page


def test_admin_add_saves_through_schedules(admin_client: Client) -> None:
    response = admin_client.post(reverse("admin:durable_schedule_add"), form_data(cron="0 9 * * 1-5"))
    assert response.status_code == 302, response.content.decode()
    schedule = models.Schedule.objects.get()
    assert (schedule.cron, schedule.input, schedule.enabled) == ("0 9 * * 1-5", {"a": 1, "b": 2}, True)
    assert PeriodicTask.objects.get().crontab.day_of_week == "1-5"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cron": "61 * * * *"}, "Invalid cron expression"),
        ({"cron": "0 9 * * *", "interval_seconds": "60"}, "not both"),
        ({}, "needs one of them"),
        ({"interval_seconds": "0"}, "from 1 to"),
        ({"interval_seconds": "60", "workflow": "no.such"}, "No workflow is registered"),
        ({"interval_seconds": "60", "timezone": "Mars/Olympus"}, "Unknown timezone"),
        ({"interval_seconds": "60", "concurrency_key": "k"}, "needs a limit"),
        ({"interval_seconds": "60", "name": "a b"}, "A schedule name must be"),
    ],
)
def test_admin_add_shows_the_validation_messages(admin_client: Client, fields: dict[str, Any], message: str) -> None:
    response = admin_client.post(reverse("admin:durable_schedule_add"), form_data(**fields))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert response.context["adminform"].form.errors
    assert beat_rows() == (0, 0, 0, 0)


def test_admin_change_updates_the_periodic_task_and_keeps_the_name(admin_client: Client) -> None:
    schedule = make("digest", cron="0 9 * * *")
    response = admin_client.post(change_url(schedule), form_data(name="renamed", interval_seconds="120"))
    assert response.status_code == 302, response.content.decode()
    schedule.refresh_from_db()
    assert (schedule.name, schedule.cron, schedule.interval_seconds) == ("digest", "", 120)
    task = PeriodicTask.objects.get()
    assert task.crontab is None and task.interval.every == 120
    page = admin_client.get(change_url(schedule)).content.decode()
    assert "A schedule keeps its name" in page


def test_admin_actions_disable_enable_and_run_now(admin_client: Client) -> None:
    schedule = make("digest", concurrency_key="sched:admin", concurrency_limit=1)

    def act(action: str) -> HttpResponse:
        return admin_client.post(SCHEDULES_URL, {"action": action, "_selected_action": [schedule.pk]}, follow=True)

    assert "Disabled 1 schedule(s): digest." in messages_of(act("disable_schedules"))
    assert not models.Schedule.objects.get().enabled and not PeriodicTask.objects.get().enabled
    assert "Enabled 1 schedule(s): digest." in messages_of(act("enable_schedules"))
    assert models.Schedule.objects.get().enabled and PeriodicTask.objects.get().enabled

    response = act("run_schedules_now")
    run = models.WorkflowRun.objects.get()
    assert run.run_id.startswith("schedule:digest:manual:")
    assert f"Schedule 'digest' started run {run.run_id}." in messages_of(response)

    response = act("run_schedules_now")  # the schedule's quota (1) is full
    [message] = messages_of(response)
    assert "skipped" in message and "'sched:admin'" in message
    assert models.WorkflowRun.objects.count() == 1
    assert "1 of 1 runs in flight" in response.content.decode()  # the changelist shows last_error


def test_admin_delete_goes_through_schedules(admin_client: Client) -> None:
    schedule = make("digest")
    other = make("other")
    response = admin_client.post(reverse("admin:durable_schedule_delete", args=[schedule.pk]), {"post": "yes"})
    assert response.status_code == 302
    assert list(models.Schedule.objects.values_list("name", flat=True)) == ["other"]
    assert list(PeriodicTask.objects.values_list("name", flat=True)) == ["durable-schedule:other"]
    admin_client.post(SCHEDULES_URL, {"action": "delete_selected", "_selected_action": [other.pk], "post": "yes"})
    assert beat_rows()[:2] == (0, 0)
