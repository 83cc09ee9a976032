"""The runs admin (with their steps): read-only; cancel and retry through the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.contrib.admin.views.main import ChangeList
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import smart_split, unescape_string_literal
from django.utils.translation import ngettext

import durable
from durable import exceptions, models
from durable.admin.display import MAX_LISTED, TAG_PARAMETER, json_column, listing, runs_with_tag_url
from durable.admin.listing import EstimatedCountPaginator, IndexedValuesFilter
from durable.concurrency import TAG_PREFIX
from durable.status import RETRYABLE_STATUSES

#: JSON columns the runs changelist does not display (they can be large).
_LIST_DEFERRED = ("input", "output", "error")


class TagFilter(admin.SimpleListFilter):
    """Runs carrying one exact tag (``?tag=concurrency:acme``).

    Shown only while it is in use: the links from a quota and from a run's tags
    set it. Listing every tag as a choice would scan the whole tag table.
    """

    title = "tag"
    parameter_name = TAG_PARAMETER

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

    output_json = json_column("output")
    error_json = json_column("error")

    def get_queryset(self, request: HttpRequest) -> QuerySet[models.StepRecord]:
        return super().get_queryset(request).order_by("position")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        run_opts = models.WorkflowRun._meta
        user = request.user
        return any(user.has_perm(f"{run_opts.app_label}.{action}_{run_opts.model_name}") for action in ("view", "change"))

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
    #: The workflow and namespace choices are read by skipping through their indexes.
    list_filter = ("status", ("workflow", IndexedValuesFilter), ("namespace", IndexedValuesFilter), TagFilter)
    #: Searched by ``get_search_results``: a run id or tag containing each word.
    search_fields = ("run_id", "tags__tag")
    search_help_text = "Search by run id or tag (for example concurrency:tenant:acme)."
    #: No second COUNT(*) over the whole table on every filtered page, and no
    #: first one either once the list is big (an estimated count).
    show_full_result_count = False
    paginator = EstimatedCountPaginator
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

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> tuple[QuerySet[Any], bool]:
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
    input_json = json_column("input")
    output_json = json_column("output")
    error_json = json_column("error")

    @admin.display(description="tags")
    def tag_list(self, run: models.WorkflowRun) -> SafeString | str:
        """Each tag links to the runs carrying it; a concurrency tag also to its quota."""
        rows = []
        for tag in sorted(t.tag for t in run.tags.all()):
            quota_link: SafeString | str = ""
            if tag.startswith(TAG_PREFIX):
                url = reverse("admin:durable_concurrencylock_change", args=[quote(tag[len(TAG_PREFIX) :])])
                quota_link = format_html(' (<a href="{}">quota</a>)', url)
            rows.append((runs_with_tag_url(tag), tag, quota_link))
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
                % {"n": len(finished), "runs": listing(finished)},
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
                % {"n": len(not_retryable), "runs": listing(not_retryable)},
                messages.WARNING,
            )
        for line in refused[:MAX_LISTED]:
            self.message_user(request, f"Could not retry run {line}", messages.ERROR)
        if len(refused) > MAX_LISTED:
            self.message_user(request, f"{len(refused) - MAX_LISTED} more runs could not be retried.", messages.ERROR)
        self._report_missing(request, missing)

    def _report_missing(self, request: HttpRequest, missing: Sequence[str]) -> None:
        if missing:
            self.message_user(
                request,
                "These runs are not visible to the engine (another namespace, with SCOPE_READS on?) "
                f"and were left as they were: {listing(missing)}.",
                messages.WARNING,
            )


def _selected(queryset: QuerySet[Any]) -> list[models.WorkflowRun]:
    """The selected runs, oldest first, with just what the actions and their log entries need."""
    return list(queryset.order_by("created_at", "pk").only("pk", "run_id", "workflow", "status"))
