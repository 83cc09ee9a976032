"""The schedules admin.

Every write goes through ``durable.schedules`` (create, update, pause, resume,
delete, run now), the only writer of the schedules' django-celery-beat rows: the
admin never saves a Schedule or a PeriodicTask itself.
"""

from __future__ import annotations

import contextlib
import zoneinfo
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

import cron_descriptor
from croniter import croniter
from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString

import durable
from durable import exceptions, models, schedules
from durable.admin.display import compact_timestamp, duration, listing, time_column, timestamp, truncated
from durable.schedules import validation, windows


def cron_in_words(cron: str) -> str:
    """``0 9 * * 1-5`` -> ``At 09:00, Monday through Friday`` (``cron-descriptor``); ``""`` if unreadable.

    A day of the month and a day of the week both given must both match (as beat's
    crontab reads them), where plain cron takes either: the words say so.
    """
    if not cron:
        return ""
    options = cron_descriptor.Options()
    options.use_24hour_time_format = True
    try:
        descriptor = cron_descriptor.ExpressionDescriptor(cron, options)
        words = descriptor.get_description()
        fields = cron.split()
        if len(fields) == 5 and fields[2] not in ("*", "?") and fields[4] not in ("*", "?"):
            weekday = descriptor.get_description(cron_descriptor.DescriptionTypeEnum.DAYOFWEEK)
            # cron-descriptor 2 joins the two with ", or on Monday", 1.x with ", only on Monday".
            for joiner in (", or ", ", only "):
                if weekday.startswith(joiner):
                    words = words.replace(weekday, ", if that day is " + weekday.removeprefix(joiner).removeprefix("on "))
                    break
    except Exception:  # cron-descriptor raises its own and plain errors on odd input: no words then
        return ""
    return str(words)


def next_window(schedule: models.Schedule, now: datetime | None = None) -> datetime | None:
    """The start of the schedule's next window after ``now`` (UTC), as ``windows.window_of``
    reads its windows; ``None`` for a paused schedule."""
    if not schedule.enabled:
        return None
    now = (now or timezone.now()).astimezone(UTC)
    if not schedule.cron:
        return windows.window_of(schedule, now) + timedelta(seconds=int(schedule.interval_seconds or 1))
    tz = zoneinfo.ZoneInfo(schedule.timezone)
    ticks = croniter(schedule.cron, now.astimezone(tz).replace(tzinfo=None, second=0, microsecond=0), day_or=False)
    for _ in range(1000):
        instant = ticks.get_next(datetime).replace(tzinfo=tz).astimezone(UTC)
        # A wall-clock tick is a window when window_of finds it (a repeated or skipped hour may not).
        if instant > now and windows.latest_tick(schedule.cron, tz, instant) == instant:
            return instant
    return None


class _ListChoiceField(forms.ChoiceField):
    """A select whose value is checked by ``validation.validate`` rather than against its
    list, so a wrong value gets the message the API and the Python functions give."""

    def valid_value(self, value: Any) -> bool:
        return True


@cache
def _timezones() -> list[tuple[str, str]]:
    return [(name, name) for name in sorted(zoneinfo.available_timezones())]


def _workflows() -> list[tuple[str, str]]:
    return [(name, name) for name in durable.engine.registry.names()]


class ScheduleForm(forms.ModelForm):
    """The add/change form. Its ``clean`` runs ``durable.schedules.validation.validate``,
    so every message of the API and the Python functions shows on its field."""

    class Meta:
        model = models.Schedule
        fields = validation.FIELDS
        labels = {"interval_seconds": "every (seconds)", "cron": "cron"}
        help_texts = {
            "cron": "Five fields: minute hour day-of-month month day-of-week, read in the timezone below "
            "(for example 0 9 * * 1-5). Leave empty for an interval.",
            "interval_seconds": "Start a run every N seconds. Leave empty for a cron expression.",
            "timezone": "IANA name, for example UTC or Europe/Paris (cron schedules only).",
            "input": "The input of every run, as JSON.",
            "concurrency_key": "The schedule's own quota: a window finding this key full is skipped and written "
            "to last error. Leave empty (and the limit too) to use the workflow's own quota.",
            "concurrency_limit": "How many runs of the key may be in flight when a window starts.",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Chosen from lists: the workflows registered in this process, the IANA timezones.
        # A saved value no longer in its list stays selectable (and validation says why it is wrong).
        workflows = _workflows()
        current = self.instance.workflow if self.instance.pk else ""
        if current and (current, current) not in workflows:
            workflows.append((current, f"{current} (not registered)"))
        self.fields["workflow"] = _ListChoiceField(
            choices=[("", "---------"), *workflows],
            label="Workflow",
            help_text="One of the workflows registered in this process.",
        )
        zones = list(_timezones())
        if self.instance.pk and (self.instance.timezone, self.instance.timezone) not in zones:
            zones.append((self.instance.timezone, self.instance.timezone))
        self.fields["timezone"] = _ListChoiceField(
            choices=zones,
            initial="UTC",
            label="Timezone",
            help_text="The timezone a cron expression is read in (cron schedules only).",
        )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or self.cleaned_data
        # A field that failed its own cleaning is checked with the instance's value,
        # as a model's clean() would see it.
        values = {field: cleaned[field] if field in cleaned else getattr(self.instance, field) for field in validation.FIELDS}
        try:
            checked = validation.validate(values)
        except exceptions.InvalidScheduleError as exc:
            for field, field_messages in exc.errors.items():
                for message in field_messages:
                    self.add_error(field if field in self.fields else None, message)
            return cleaned
        for field in ("cron", "input"):
            cleaned[field] = checked[field]
        return cleaned


@admin.register(models.Schedule)
class ScheduleAdmin(admin.ModelAdmin):
    """Schedules: list (with the last error of each), add, change, enable, disable,
    run now and delete, all through ``durable.schedules``.

    A schedule keeps its name (it is part of its runs' ids): the field is
    disabled on the change page.
    """

    form = ScheduleForm
    #: Six columns, so that the list reads at 1400 px with both sidebars open: a
    #: paused schedule says so in "next window", its own quota is under its workflow.
    list_display = ("name", "workflow_quota", "when", "next_window", "last_window", "last_error_display")
    list_filter = ("enabled", "workflow", "namespace")
    search_fields = ("name", "workflow", "concurrency_key")
    ordering = ("name",)
    actions = ("enable_schedules", "disable_schedules", "run_schedules_now")
    fieldsets = (
        ("Last window", {"fields": ("last_error_full", "last_error_time", "last_window", "last_run", "periodic_task")}),
        (None, {"fields": ("name", "workflow", "input", "namespace", "enabled")}),
        ("When", {"fields": ("cron", "cron_words", "interval_seconds", "timezone", "next_window")}),
        ("Quota of its own", {"fields": ("concurrency_key", "concurrency_limit")}),
    )
    readonly_fields = (
        "last_error_full",
        "last_error_time",
        "last_window",
        "last_run",
        "periodic_task",
        "cron_words",
        "next_window",
    )

    class Media:
        css = {"all": ("durable/admin.css",)}

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is not None:
            return fieldsets
        # An unsaved schedule has no last window yet, nor a next one.
        when = ("When", {"fields": ("cron", "interval_seconds", "timezone")})
        return [when if title == "When" else (title, options) for title, options in fieldsets[1:]]

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        if obj is not None and "name" in form.base_fields:
            form.base_fields["name"].disabled = True
            form.base_fields["name"].help_text = "A schedule keeps its name: it is part of its runs' ids."
        return form

    # -- saving and deleting through durable.schedules ------------------------------
    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        saved = schedules.save_instance(obj)
        for field in saved._meta.concrete_fields:
            setattr(obj, field.attname, getattr(saved, field.attname))

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        schedules.delete_schedule(obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for schedule in queryset.order_by("name"):
            with contextlib.suppress(exceptions.ScheduleNotFound):  # deleted meanwhile
                schedules.delete_schedule(schedule)

    # -- columns ----------------------------------------------------------------------
    @admin.display(description="when")
    def when(self, schedule: models.Schedule) -> SafeString | str:
        """``cron 0 9 * * 1-5 (Europe/Paris)`` with the expression in words below it, or ``every 60s``."""
        if not schedule.cron:
            return schedules.when(schedule)
        return format_html(
            '{} ({})<br><span class="durable-cron-words">{}</span>',
            schedules.when(schedule),
            schedule.timezone,
            cron_in_words(schedule.cron),
        )

    @admin.display(description="in words")
    def cron_words(self, schedule: models.Schedule) -> str:
        return cron_in_words(schedule.cron)

    @admin.display(description="next window")
    def next_window(self, schedule: models.Schedule) -> SafeString | str:
        if not schedule.enabled:
            return "paused"
        try:
            upcoming = next_window(schedule)
        except (ValueError, KeyError, zoneinfo.ZoneInfoNotFoundError):  # an invalid saved cron or timezone
            return ""
        if upcoming is None:
            return ""
        # A cron schedule's window in its own timezone (the UTC time in the tooltip).
        wall = upcoming.astimezone(zoneinfo.ZoneInfo(schedule.timezone)) if schedule.cron else upcoming
        return format_html(
            '<span class="durable-duration">in {}</span><br><span class="durable-time" title="{}">{}<br>{} {}</span>',
            duration(upcoming - timezone.now()),
            timestamp(upcoming),
            wall.strftime("%Y-%m-%d"),
            wall.strftime("%H:%M:%S"),
            wall.tzname() or "",
        )

    @admin.display(description="last window", ordering="last_run_at")
    def last_window(self, schedule: models.Schedule) -> SafeString | str:
        """When the last window started a run (linked to that run)."""
        if schedule.last_run_at is None:
            return ""
        if not schedule.last_run_id:
            return compact_timestamp(schedule.last_run_at)
        url = reverse("admin:durable_workflowrun_changelist") + "?" + urlencode({"q": schedule.last_run_id})
        return format_html(
            '<a href="{}" title="run {}">{}</a>', url, schedule.last_run_id, compact_timestamp(schedule.last_run_at)
        )

    @admin.display(description="workflow", ordering="workflow")
    def workflow_quota(self, schedule: models.Schedule) -> SafeString:
        quota = self.own_quota(schedule)
        below = format_html('<br><span class="durable-quiet">own quota {}</span>', quota) if quota else ""
        return format_html("{}{}", schedule.workflow, below)

    @admin.display(description="own quota")
    def own_quota(self, schedule: models.Schedule) -> str | None:
        if not schedule.concurrency_key:
            return None
        return f"{schedule.concurrency_key} (limit {schedule.concurrency_limit})"

    @admin.display(description="last run")
    def last_run(self, schedule: models.Schedule) -> SafeString | str:
        if not schedule.last_run_id:
            return ""
        url = reverse("admin:durable_workflowrun_changelist") + "?" + urlencode({"q": schedule.last_run_id})
        return format_html('<a href="{}">{}</a>', url, schedule.last_run_id)

    @admin.display(description="last error", ordering="last_error_at")
    def last_error_display(self, schedule: models.Schedule) -> SafeString | str:
        """The last error on one line, cut short (the whole of it in the tooltip), with its time."""
        if not schedule.last_error:
            return ""
        return format_html(
            '<span class="durable-error">{}</span><br><span class="durable-time">{}</span>',
            truncated(schedule.last_error, 60),
            timestamp(schedule.last_error_at),
        )

    @admin.display(description="last error")
    def last_error_full(self, schedule: models.Schedule) -> SafeString | str:
        if not schedule.last_error:
            return ""
        return format_html('<strong class="durable-error" style="white-space:pre-wrap">{}</strong>', schedule.last_error)

    last_error_time = time_column("last_error_at", "last error at")

    # -- actions ----------------------------------------------------------------------
    @admin.action(description="Enable selected schedules", permissions=["change"])
    def enable_schedules(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._set_enabled(request, queryset, True)

    @admin.action(description="Disable selected schedules", permissions=["change"])
    def disable_schedules(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._set_enabled(request, queryset, False)

    def _set_enabled(self, request: HttpRequest, queryset: QuerySet[Any], enabled: bool) -> None:
        done: list[str] = []
        for schedule in queryset.order_by("name"):
            try:
                (schedules.resume if enabled else schedules.pause)(schedule)
            except exceptions.ScheduleNotFound:
                continue
            done.append(schedule.name)
            self.log_change(request, schedule, "Enabled through the admin." if enabled else "Disabled through the admin.")
        verb = "Enabled" if enabled else "Disabled"
        self.message_user(request, f"{verb} {len(done)} schedule(s): {listing(done)}.", messages.SUCCESS)

    @admin.action(description="Run selected schedules now", permissions=["change"])
    def run_schedules_now(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Start one run of each schedule at once, under the schedule's quota."""
        for schedule in queryset.order_by("name"):
            try:
                firing = schedules.run_now(schedule)
            except exceptions.ScheduleNotFound:
                continue
            if firing.started:
                self.log_change(request, schedule, f"Ran now through the admin: run {firing.run_id}.")
                self.message_user(request, f"Schedule {schedule.name!r} started run {firing.run_id}.", messages.SUCCESS)
            else:
                self.message_user(request, f"Schedule {schedule.name!r}: {firing.error}", messages.WARNING)
