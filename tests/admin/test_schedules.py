"""Schedules in the admin: workflow and timezone chosen from lists, the next window,
the cron expression in words, and a last error that reads on one line."""

from __future__ import annotations

import re
import zoneinfo
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from durable import engine, models, schedules
from durable.admin.schedules import ScheduleForm, cron_in_words, next_window
from durable.schedules import windows
from tests.admin.helpers import SCHEDULES_URL, listed, row

ERROR = (
    "Concurrency limit reached for key 'tenant:stark': 1 of 1 runs in flight (limit 1). The window "
    "2026-12-01T08:00:00Z was skipped; the next window starts the run if a slot is free then."
)


def _schedule(**fields: object) -> models.Schedule:
    values: dict[str, object] = {"name": "digest", "workflow": "test.add", "cron": "0 9 * * 1-5", "timezone": "Europe/Paris"}
    values.update(fields)
    if values.get("interval_seconds"):
        values["cron"] = ""
    return models.Schedule(**values)


# -- the form ----------------------------------------------------------------------------------


def test_workflow_and_timezone_are_chosen_from_lists() -> None:
    form = ScheduleForm()
    workflows = [value for value, _ in form.fields["workflow"].choices]
    assert workflows == ["", *engine.registry.names()] and "test.add" in workflows
    zones = [value for value, _ in form.fields["timezone"].choices]
    assert zones == sorted(zoneinfo.available_timezones()) and "Europe/Paris" in zones
    html = form.as_p()
    assert '<select name="workflow"' in html and '<select name="timezone"' in html
    assert '<option value="UTC" selected>UTC</option>' in html


@pytest.mark.django_db
def test_a_saved_workflow_no_longer_registered_stays_selectable() -> None:
    schedule = schedules.create_schedule("old", "test.add", {"a": 1, "b": 2}, every=60)
    models.Schedule.objects.filter(pk=schedule.pk).update(workflow="gone.workflow")
    schedule.refresh_from_db()
    choices = dict(ScheduleForm(instance=schedule).fields["workflow"].choices)
    assert choices["gone.workflow"] == "gone.workflow (not registered)"


@pytest.mark.django_db
def test_the_add_page_offers_the_lists(admin_client: Client) -> None:
    content = admin_client.get(reverse("admin:durable_schedule_add")).content.decode()
    assert '<option value="test.add">test.add</option>' in content
    assert '<option value="Europe/Paris">Europe/Paris</option>' in content
    assert "Next window" not in content  # nothing to compute before it is saved


# -- next window -------------------------------------------------------------------------------


def test_next_window_of_a_cron_schedule_in_its_timezone() -> None:
    now = datetime(2026, 12, 4, 8, 30, tzinfo=UTC)  # a Friday, 09:30 in Paris
    nxt = next_window(_schedule(), now)
    assert nxt == datetime(2026, 12, 7, 8, 0, tzinfo=UTC)  # Monday 09:00 Paris (UTC+1)
    assert windows.window_of(_schedule(), nxt) == nxt  # the window the schedule will fire
    assert windows.window_of(_schedule(), nxt - timedelta(seconds=1)) < nxt


def test_next_window_of_an_interval_schedule_and_of_a_paused_one() -> None:
    now = datetime(2026, 12, 4, 8, 30, 10, tzinfo=UTC)
    assert next_window(_schedule(interval_seconds=300), now) == datetime(2026, 12, 4, 8, 35, tzinfo=UTC)
    assert next_window(_schedule(enabled=False), now) is None


@pytest.mark.parametrize(
    ("cron", "now"),
    [
        ("30 2 * * *", datetime(2026, 3, 29, 0, 0, tzinfo=UTC)),  # 02:30 does not exist that night in Paris
        ("30 2 * * *", datetime(2026, 10, 25, 0, 0, tzinfo=UTC)),  # 02:30 happens twice
        ("*/15 * * * *", datetime(2026, 10, 25, 0, 50, tzinfo=UTC)),
    ],
)
def test_next_window_across_a_change_of_the_clocks_is_a_window(cron: str, now: datetime) -> None:
    schedule = _schedule(cron=cron)
    nxt = next_window(schedule, now)
    assert nxt is not None and nxt > now
    assert windows.window_of(schedule, nxt) == nxt
    # No window in between was skipped.
    assert windows.window_of(schedule, nxt - timedelta(seconds=1)) <= now


# -- cron in words ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cron", "words"),
    [
        ("0 9 * * 1-5", "At 09:00, Monday through Friday"),
        ("*/15 * * * *", "Every 15 minutes"),
        ("30 6 1 * *", "At 06:30, on day 1 of the month"),
        # Both days given: beat's crontab needs both to match, which the words must say.
        ("0 9 1-7 * 1", "At 09:00, between day 1 and 7 of the month, if that day is Monday"),
        ("", ""),
        ("not a cron", ""),
    ],
)
def test_cron_in_words(cron: str, words: str) -> None:
    assert cron_in_words(cron) == words


# -- the list and the change page ----------------------------------------------------------------

#: The next window of a weekday cron, in words: "in 2d 3h", "in 5h 12m", or "in 2d" when
#: its hours are 0 (a Saturday morning, from Monday 09:00 Paris time).
NEXT_WINDOW_IN = r">in \d+[dhm]( \d+[hm])?<"


@pytest.mark.django_db
def test_the_list_shows_next_window_words_and_a_truncated_last_error(admin_client: Client) -> None:
    digest = schedules.create_schedule("digest", "test.add", {"a": 1, "b": 2}, cron="0 9 * * 1-5", timezone="Europe/Paris")
    models.Schedule.objects.filter(pk=digest.pk).update(last_error=ERROR, last_error_at=timezone.now() - timedelta(hours=3))
    schedules.create_schedule("tick", "test.add", {"a": 1, "b": 2}, every=300)
    schedules.create_schedule("paused", "test.add", {"a": 1, "b": 2}, every=60, enabled=False)
    response = admin_client.get(SCHEDULES_URL)
    assert listed(response) == ["digest", "paused", "tick"]
    content = response.content.decode()

    digest_row = row(content, "digest")
    assert "At 09:00, Monday through Friday" in digest_row and "(Europe/Paris)" in digest_row
    assert re.search(NEXT_WINDOW_IN, digest_row)
    assert re.search(r">09:00:00 CES?T<", digest_row)
    # The error: cut short on the list, whole in the tooltip.
    assert f'title="{escape(ERROR)}"' in digest_row
    assert escape(ERROR) not in digest_row.replace(f'title="{escape(ERROR)}"', "")
    assert "…" in digest_row
    assert ">paused<" in row(content, "paused")
    assert re.search(r"in [1-5]m|in \d+s", row(content, "tick"))


@pytest.mark.django_db
def test_the_change_page_shows_words_next_window_and_the_whole_error(admin_client: Client) -> None:
    digest = schedules.create_schedule("digest", "test.add", {"a": 1, "b": 2}, cron="0 9 * * 1-5", timezone="Europe/Paris")
    models.Schedule.objects.filter(pk=digest.pk).update(last_error=ERROR, last_error_at=timezone.now())
    content = admin_client.get(reverse("admin:durable_schedule_change", args=[digest.pk])).content.decode()
    assert "At 09:00, Monday through Friday" in content
    assert "Next window" in content and re.search(NEXT_WINDOW_IN, content)
    assert escape(ERROR) in content
    assert '<option value="Europe/Paris" selected>Europe/Paris</option>' in content
    assert '<option value="test.add" selected>test.add</option>' in content
