"""The Django admin of durable: runs (with their steps), concurrency quotas and schedules.

Runs and quotas are read-only. A run changes state only through the engine
(``durable.engine.cancel`` / ``durable.engine.retry``, offered as actions), so
the admin never writes a status, a tag or a step row itself: the quota counts
stay exact whatever an operator clicks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.contrib.admin.views.main import ChangeList
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import smart_split, unescape_string_literal
from django.utils.timesince import timesince
from django.utils.translation import ngettext

import durable
from durable import exceptions, models, quotas, schedules
from durable.concurrency import TAG_PREFIX
from durable.status import RunStatus

#: Statuses ``Engine.retry`` accepts.
RETRYABLE_STATUSES: frozenset[str] = frozenset({RunStatus.FAILED, RunStatus.DEAD, RunStatus.CANCELLED})

#: How many run ids a message lists before it says "and N more".
_MAX_LISTED = 10

#: JSON columns the runs changelist does not display (they can be large).
_LIST_DEFERRED = ("input", "output", "error")


def _pretty_json(value: Any) -> SafeString | str:
    """``value`` as indented JSON in a ``<pre>`` block (escaped); empty for ``None``."""
    if value is None:
        return ""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)
    return format_html('<pre style="margin:0; white-space:pre-wrap">{}</pre>', text)


def _listing(items: Sequence[str]) -> str:
    """``a, b, c`` (at most ``_MAX_LISTED`` of them, then ``and N more``)."""
    shown = ", ".join(items[:_MAX_LISTED])
    rest = len(items) - _MAX_LISTED
    return f"{shown} and {rest} more" if rest > 0 else shown


def _runs_with_tag_url(tag: str) -> str:
    return reverse("admin:durable_workflowrun_changelist") + "?" + urlencode({TagFilter.parameter_name: tag})


# -- runs -------------------------------------------------------------------------


class TagFilter(admin.SimpleListFilter):
    """Runs carrying one exact tag (``?tag=concurrency:acme``).

    Shown only while it is in use: the links from a quota and from a run's tags
    set it. Listing every tag as a choice would scan the whole tag table.
    """

    title = "tag"
    parameter_name = "tag"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, value)] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if not value:
            return queryset
        # (run, tag) is unique, so the join cannot duplicate a run.
        return queryset.filter(tags__tag=value)


class _RunChangeList(ChangeList):
    """The runs changelist does not load the JSON columns it does not show."""

    def get_queryset(self, request: HttpRequest, *args: Any, **kwargs: Any) -> QuerySet[Any]:
        return super().get_queryset(request, *args, **kwargs).defer(*_LIST_DEFERRED)


class StepRecordInline(admin.TabularInline):
    """The journal of a run, in step order, read-only.

    Visible to whoever may view the run: the steps are part of it.
    """

    model = models.StepRecord
    fields = ("position", "name", "outcome", "attempts", "output_json", "error_json", "started_at", "finished_at")
    readonly_fields = fields
    ordering = ("position",)
    extra = 0
    can_delete = False
    show_change_link = False
    verbose_name = "step"
    verbose_name_plural = "steps"

    @admin.display(description="output")
    def output_json(self, step: models.StepRecord) -> SafeString | str:
        return _pretty_json(step.output)

    @admin.display(description="error")
    def error_json(self, step: models.StepRecord) -> SafeString | str:
        return _pretty_json(step.error)

    def get_queryset(self, request: HttpRequest) -> QuerySet[models.StepRecord]:
        return super().get_queryset(request).order_by("position")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        run_opts = models.WorkflowRun._meta
        user = request.user
        return any(
            user.has_perm(f"{run_opts.app_label}.{action}_{run_opts.model_name}") for action in ("view", "change")
        )

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(models.WorkflowRun)
class WorkflowRunAdmin(admin.ModelAdmin):
    """Runs: filter, search by run id or tag, inspect, cancel and retry.

    Permissions:

    - No adding: a run is created by a start, under its quota.
    - No editing: the change page is a read-only view. Cancelling and retrying
      go through the engine, whose compare-and-set transitions keep the tag
      statuses (and so the quota counts) in step with the run. The two actions
      require the "change workflow run" permission.
    - No deleting, not even of finished runs. Deleting here would be a read
      followed by a delete: a run retried in between would vanish while a worker
      runs it, and its slot would be freed under the quota. Purge old runs with a
      guarded ``DELETE ... WHERE status IN (terminal statuses)`` instead.
    """

    list_display = (
        "run_id",
        "workflow",
        "version",
        "namespace",
        "status",
        "attempt",
        "created_at",
        "finished_at",
    )
    list_filter = ("status", "workflow", "namespace", TagFilter)
    #: Searched by ``get_search_results``: a run id or tag containing each word.
    search_fields = ("run_id", "tags__tag")
    search_help_text = "Search by run id or tag (for example concurrency:tenant:acme)."
    #: No second COUNT(*) over the whole table on every filtered page.
    show_full_result_count = False
    inlines = (StepRecordInline,)
    actions = ("cancel_runs", "retry_runs")
    fieldsets = (
        (None, {"fields": ("run_id", "workflow", "version", "namespace", "status", "attempt", "parent", "tag_list")}),
        ("Input and result", {"fields": ("input_json", "output_json", "error_json")}),
        (
            "Execution",
            {
                "fields": (
                    "queue",
                    "waiting_for",
                    "wake_at",
                    "worker",
                    "created_at",
                    "dispatched_at",
                    "started_at",
                    "heartbeat_at",
                    "updated_at",
                    "finished_at",
                )
            },
        ),
    )
    readonly_fields = (
        "run_id",
        "workflow",
        "version",
        "namespace",
        "status",
        "attempt",
        "parent",
        "tag_list",
        "queue",
        "waiting_for",
        "wake_at",
        "input_json",
        "output_json",
        "error_json",
        "worker",
        "created_at",
        "dispatched_at",
        "started_at",
        "heartbeat_at",
        "updated_at",
        "finished_at",
    )

    # -- engine ----------------------------------------------------------------
    def get_engine(self) -> durable.Engine:
        """The engine the actions go through (the default one, read at call time)."""
        return durable.engine

    # -- permissions -------------------------------------------------------------
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Without an object this gates the actions; with one, the change page is
        # a read-only view.
        if obj is not None:
            return False
        return super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # -- changelist ----------------------------------------------------------------
    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _RunChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """Runs whose id or one of whose tags contains every word of ``search_term``.

        The tag match is an ``EXISTS`` subquery rather than a join, so a run with
        several matching tags is listed once without a ``DISTINCT`` over the
        run's (possibly large) JSON columns.
        """
        condition = Q()
        for bit in smart_split(search_term):
            if bit.startswith(('"', "'")) and bit[0] == bit[-1]:
                bit = unescape_string_literal(bit)
            if not bit:
                continue
            tagged = models.RunTag.objects.filter(run=OuterRef("pk"), tag__icontains=bit)
            condition &= Q(run_id__icontains=bit) | Q(Exists(tagged))
        return (queryset.filter(condition) if condition else queryset), False

    # -- change page -----------------------------------------------------------------
    @admin.display(description="input")
    def input_json(self, run: models.WorkflowRun) -> SafeString | str:
        return _pretty_json(run.input)

    @admin.display(description="output")
    def output_json(self, run: models.WorkflowRun) -> SafeString | str:
        return _pretty_json(run.output)

    @admin.display(description="error")
    def error_json(self, run: models.WorkflowRun) -> SafeString | str:
        return _pretty_json(run.error)

    @admin.display(description="tags")
    def tag_list(self, run: models.WorkflowRun) -> SafeString | str:
        """Each tag links to the runs carrying it; a concurrency tag also to its quota."""
        rows = []
        for tag in sorted(t.tag for t in run.tags.all()):
            quota_link: SafeString | str = ""
            if tag.startswith(TAG_PREFIX):
                url = reverse("admin:durable_concurrencylock_change", args=[quote(tag[len(TAG_PREFIX) :])])
                quota_link = format_html(' (<a href="{}">quota</a>)', url)
            rows.append((_runs_with_tag_url(tag), tag, quota_link))
        return format_html_join(mark_safe("<br>"), '<a href="{}">{}</a>{}', rows)

    # -- actions ---------------------------------------------------------------------
    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        engine = self.get_engine()
        cancelled: list[str] = []
        finished: list[str] = []
        missing: list[str] = []
        for run in _selected(queryset):
            run_id = run.run_id
            try:
                engine.cancel(run_id)
            except exceptions.RunTerminalError as exc:
                finished.append(f"{run_id} ({getattr(exc, 'status', 'finished')})")
            except exceptions.RunNotFound:
                missing.append(run_id)
            else:
                cancelled.append(run_id)
                self.log_change(request, run, "Cancelled through the admin.")
        if cancelled:
            self.message_user(
                request,
                ngettext("Cancelled %(n)d run.", "Cancelled %(n)d runs.", len(cancelled)) % {"n": len(cancelled)},
                messages.SUCCESS,
            )
        if finished:
            self.message_user(
                request,
                ngettext(
                    "%(n)d run had already finished and was left as it was: %(runs)s.",
                    "%(n)d runs had already finished and were left as they were: %(runs)s.",
                    len(finished),
                )
                % {"n": len(finished), "runs": _listing(finished)},
                messages.WARNING,
            )
        self._report_missing(request, missing)

    @admin.action(description="Retry selected runs", permissions=["change"])
    def retry_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Start failed, dead and cancelled runs again (oldest first), each under its quota."""
        engine = self.get_engine()
        retried: list[str] = []
        not_retryable: list[str] = []
        refused: list[str] = []
        missing: list[str] = []
        for run in _selected(queryset):
            run_id, status = run.run_id, run.status
            if status not in RETRYABLE_STATUSES:
                not_retryable.append(f"{run_id} ({status})")
                continue
            try:
                engine.retry(run_id)
            except exceptions.RunTerminalError as exc:
                # Its status changed since the page was read.
                not_retryable.append(f"{run_id} ({getattr(exc, 'status', status)})")
            except exceptions.RunNotFound:
                missing.append(run_id)
            except exceptions.DurableError as exc:
                # A full quota, an unregistered workflow version, a key function
                # failing on the input: the run stays as it was.
                refused.append(f"{run_id}: {exc}")
            else:
                retried.append(run_id)
                self.log_change(request, run, "Retried through the admin.")
        if retried:
            self.message_user(
                request,
                ngettext(
                    "Retried %(n)d run: it is pending again.",
                    "Retried %(n)d runs: they are pending again.",
                    len(retried),
                )
                % {"n": len(retried)},
                messages.SUCCESS,
            )
        if not_retryable:
            self.message_user(
                request,
                ngettext(
                    "%(n)d run was not retried: only failed, dead or cancelled runs can be retried: %(runs)s.",
                    "%(n)d runs were not retried: only failed, dead or cancelled runs can be retried: %(runs)s.",
                    len(not_retryable),
                )
                % {"n": len(not_retryable), "runs": _listing(not_retryable)},
                messages.WARNING,
            )
        for line in refused[:_MAX_LISTED]:
            self.message_user(request, f"Could not retry run {line}", messages.ERROR)
        if len(refused) > _MAX_LISTED:
            self.message_user(
                request, f"{len(refused) - _MAX_LISTED} more runs could not be retried.", messages.ERROR
            )
        self._report_missing(request, missing)

    def _report_missing(self, request: HttpRequest, missing: Sequence[str]) -> None:
        if missing:
            self.message_user(
                request,
                "These runs are not visible to the engine (another namespace, with SCOPE_READS on?) "
                f"and were left as they were: {_listing(missing)}.",
                messages.WARNING,
            )


def _selected(queryset: QuerySet[Any]) -> list[models.WorkflowRun]:
    """The selected runs, oldest first, with just what the actions and their log entries need."""
    return list(queryset.order_by("created_at", "pk").only("pk", "run_id", "workflow", "status"))


# -- quotas -----------------------------------------------------------------------


class _QuotaChangeList(ChangeList):
    """Attaches each listed key's ``QuotaInfo`` (``quota_info``) to its row.

    ``quota_infos()`` computes every key's counts in one grouped query, so a page
    costs the same number of queries whatever its length.
    """

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        infos = {info.key: info for info in quotas.quota_infos()}
        for lock in self.result_list:  # fills the page's result cache
            lock.quota_info = infos.get(lock.key)


def _info(lock: models.ConcurrencyLock) -> quotas.QuotaInfo | None:
    if not hasattr(lock, "quota_info"):
        # Outside the changelist (the change page): this key's counts only.
        found = quotas.quota_infos(key=lock.key)
        lock.quota_info = found[0] if found else None  # type: ignore[attr-defined]
    info: quotas.QuotaInfo | None = lock.quota_info  # type: ignore[attr-defined]
    return info


@admin.register(models.ConcurrencyLock)
class ConcurrencyQuotaAdmin(admin.ModelAdmin):
    """Concurrency quotas, one row per key ever used: read-only.

    ``limit`` and ``count_statuses`` are the values the latest start of the key
    used, admitted or refused (a limit computed per start may differ from one
    start to the next).
    ``active`` counts the key's runs in those statuses across every namespace,
    ``queued`` its queued runs, "oldest in flight" is the creation time of the
    oldest counted run and "oldest queued" how long the head of its queue has waited.
    """

    list_display = ("key", "limit", "active", "queued", "oldest_queued", "oldest_in_flight", "counted_statuses", "runs")
    search_fields = ("key",)
    ordering = ("key",)
    show_full_result_count = False
    fields = ("key", "limit", "active", "queued", "oldest_queued", "oldest_in_flight", "counted_statuses", "created_at", "runs")
    readonly_fields = fields
    empty_value_display = "—"

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _QuotaChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="active")
    def active(self, lock: models.ConcurrencyLock) -> int:
        info = _info(lock)
        return info.active if info else 0

    @admin.display(description="queued")
    def queued(self, lock: models.ConcurrencyLock) -> int:
        info = _info(lock)
        return info.queued if info else 0

    @admin.display(description="oldest queued")
    def oldest_queued(self, lock: models.ConcurrencyLock) -> str | None:
        info = _info(lock)
        if info is None or info.oldest_queued_at is None:
            return None
        return f"waiting {timesince(info.oldest_queued_at)}"

    @admin.display(description="oldest in flight")
    def oldest_in_flight(self, lock: models.ConcurrencyLock) -> Any:
        info = _info(lock)
        return info.oldest_active_at if info else None

    @admin.display(description="counted statuses")
    def counted_statuses(self, lock: models.ConcurrencyLock) -> str:
        info = _info(lock)
        statuses: Sequence[str] = info.count_statuses if info else (lock.count_statuses or ())
        return ", ".join(statuses)

    @admin.display(description="runs")
    def runs(self, lock: models.ConcurrencyLock) -> SafeString:
        return format_html('<a href="{}">runs of this key</a>', _runs_with_tag_url(TAG_PREFIX + lock.key))


# -- schedules --------------------------------------------------------------------
#
# Persisted schedules. Every write goes through ``durable.schedules`` (create,
# update, pause, resume, delete, run now), the only writer of the schedules'
# django-celery-beat rows: the admin never saves a Schedule or a PeriodicTask itself.


class ScheduleForm(forms.ModelForm):
    """The add/change form. ``Schedule.clean()`` runs ``durable.schedules.validate``,
    so every message of the API and the Python functions shows on its field."""

    class Meta:
        model = models.Schedule
        fields = schedules.FIELDS
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
            try:
                schedules.delete_schedule(schedule)
            except exceptions.ScheduleNotFound:
                pass  # deleted meanwhile

    # -- columns ----------------------------------------------------------------------
    @admin.display(description="when")
    def when(self, schedule: models.Schedule) -> str:
        return f"cron {schedule.cron}" if schedule.cron else f"every {schedule.interval_seconds}s"

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
        self.message_user(request, f"{verb} {len(done)} schedule(s): {_listing(done)}.", messages.SUCCESS)

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
                self.message_user(
                    request, f"Schedule {schedule.name!r} started run {firing.run_id}.", messages.SUCCESS
                )
            else:
                self.message_user(request, f"Schedule {schedule.name!r}: {firing.error}", messages.WARNING)
