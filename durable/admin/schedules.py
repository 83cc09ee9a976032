"""The schedules admin.

Every write goes through ``durable.schedules`` (create, update, pause, resume,
delete, run now), the only writer of the schedules' django-celery-beat rows: the
admin never saves a Schedule or a PeriodicTask itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString

import durable
from durable import exceptions, models, schedules
from durable.admin.display import listing
from durable.schedules import validation


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
    list_display = (
        "name",
        "workflow",
        "when",
        "timezone",
        "enabled",
        "own_quota",
        "last_run_at",
        "last_run",
        "last_error_display",
    )
    list_filter = ("enabled", "workflow", "namespace")
    search_fields = ("name", "workflow", "concurrency_key")
    ordering = ("name",)
    actions = ("enable_schedules", "disable_schedules", "run_schedules_now")
    fieldsets = (
        ("Last window", {"fields": ("last_error_display", "last_error_at", "last_run_at", "last_run", "periodic_task")}),
        (None, {"fields": ("name", "workflow", "input", "namespace", "enabled")}),
        ("When", {"fields": ("cron", "interval_seconds", "timezone")}),
        ("Quota of its own", {"fields": ("concurrency_key", "concurrency_limit")}),
    )
    readonly_fields = ("last_error_display", "last_error_at", "last_run_at", "last_run", "periodic_task")

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        # An unsaved schedule has no last window yet.
        return fieldsets if obj is not None else fieldsets[1:]

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        if "workflow" in form.base_fields:
            known = ", ".join(durable.engine.registry.names()) or "none"
            form.base_fields["workflow"].help_text = f"A registered workflow: {known}."
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
    def when(self, schedule: models.Schedule) -> str:
        return schedules.when(schedule)

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
        if not schedule.last_error:
            return ""
        return format_html(
            '<strong class="errornote" style="display:block; margin:0; color:#ba2121">{}</strong>',
            schedule.last_error,
        )

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
