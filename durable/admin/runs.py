"""The runs admin (with their steps): read-only; cancel and retry through the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import smart_split, unescape_string_literal
from django.utils.translation import ngettext

import durable
from durable import exceptions, models
from durable.admin.display import (
    MAX_LISTED,
    TAG_PARAMETER,
    age,
    duration,
    json_column,
    listing,
    runs_with_tag_url,
    time_column,
)
from durable.admin.listing import EstimatedCountPaginator, IndexedValuesFilter
from durable.concurrency import TAG_PREFIX
from durable.status import ACTIVE_STATUSES, RETRYABLE_STATUSES, TERMINAL_STATUSES, RunStatus

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
    """The runs changelist does not load the JSON columns it does not show, and reads
    the concurrency keys of the page's runs in one query (``concurrency_keys``)."""

    def get_queryset(self, request: HttpRequest, *args: Any, **kwargs: Any) -> QuerySet[Any]:
        return super().get_queryset(request, *args, **kwargs).defer(*_LIST_DEFERRED)

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        page = list(self.result_list)
        keys: dict[int, list[str]] = {}
        tags = models.RunTag.objects.filter(run__in=[run.pk for run in page], tag__startswith=TAG_PREFIX)
        for run_pk, tag in tags.order_by("tag").values_list("run_id", "tag"):
            keys.setdefault(run_pk, []).append(tag[len(TAG_PREFIX) :])
        for run in page:
            run.concurrency_keys = keys.get(run.pk, [])
        self.result_list = page


def run_duration(run: models.WorkflowRun, now: Any = None) -> str:
    """How long the run took (started to finished), has run so far, or has waited to start."""
    if run.status in TERMINAL_STATUSES:
        if run.started_at is None or run.finished_at is None:
            return "never started" if run.started_at is None else ""
        return duration(run.finished_at - run.started_at)
    if run.status in (RunStatus.PENDING, RunStatus.QUEUED) or run.started_at is None:
        return f"waiting {age(run.created_at, now)}"
    return f"{age(run.started_at, now)} so far"


def step_duration(step: models.StepRecord) -> str:
    """started -> finished of a journaled step (a wait's row: when it began waiting)."""
    if step.started_at is None or step.finished_at is None:
        return ""
    return duration(step.finished_at - step.started_at)


class StepRecordInline(admin.TabularInline):
    """The journal of a run, in step order, read-only.

    Visible to whoever may view the run: the steps are part of it.
    """

    model = models.StepRecord
    fields = ("position", "name", "outcome", "attempts", "took", "started", "finished", "output_json", "error_json")
    readonly_fields = fields
    ordering = ("position",)
    extra = 0
    can_delete = False
    show_change_link = False
    verbose_name = "step"
    verbose_name_plural = "steps"

    output_json = json_column("output")
    error_json = json_column("error")
    started = time_column("started_at", "started")
    finished = time_column("finished_at", "finished")

    @admin.display(description="took")
    def took(self, step: models.StepRecord) -> str:
        return step_duration(step)

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

    #: Narrow enough for 1400 px with both sidebars open: the namespace shows under the
    #: workflow when it is not the default, a second attempt next to the status.
    list_display = ("run_id", "workflow_version", "status_mark", "keys", "created_short", "took", "finished_short")
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
    change_form_template = "admin/durable/workflowrun/change_form.html"
    #: The run's page: what it is, its input and result, how it executes. Every field is
    #: read-only: a run changes state only through the engine.
    _SUMMARY = (
        "run_id",
        "workflow",
        "version",
        "namespace",
        "status_mark",
        "current_step",
        "took",
        "attempt",
        "parent",
        "tag_list",
    )
    _RESULT = (
        "input_json",
        "output_json",
        "error_json",
        "replaced_by",
    )
    _EXECUTION = (
        "queue",
        "waiting_for",
        "wake",
        "worker",
        "created",
        "dispatched",
        "started",
        "heartbeat",
        "updated",
        "finished",
    )
    fieldsets = ((None, {"fields": _SUMMARY}), ("Input and result", {"fields": _RESULT}), ("Execution", {"fields": _EXECUTION}))
    readonly_fields = _SUMMARY + _RESULT + _EXECUTION

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or obj.status not in TERMINAL_STATUSES:
            return fieldsets
        # A finished run is doing nothing now: no empty "now" row on its page.
        summary = tuple(f for f in self._SUMMARY if f != "current_step")
        return ((None, {"fields": summary}), *fieldsets[1:])

    class Media:
        css = {"all": ("durable/admin.css",)}

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

    # -- the run's page: cancel and retry buttons -------------------------------------------
    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        own = [
            path("<path:object_id>/cancel/", self.admin_site.admin_view(self.cancel_view), name="{}_{}_cancel".format(*info)),
            path("<path:object_id>/retry/", self.admin_site.admin_view(self.retry_view), name="{}_{}_retry".format(*info)),
        ]
        return own + super().get_urls()

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        run = self.get_object(request, unquote(object_id))
        context = dict(extra_context or {})
        if run is not None and self.has_change_permission(request):
            info = self.opts.app_label, self.opts.model_name
            context["durable_can_cancel"] = run.status in ACTIVE_STATUSES
            context["durable_can_retry"] = run.status in RETRYABLE_STATUSES
            context["durable_cancel_url"] = reverse("admin:{}_{}_cancel".format(*info), args=[quote(run.pk)])
            context["durable_retry_url"] = reverse("admin:{}_{}_retry".format(*info), args=[quote(run.pk)])
        return super().change_view(request, object_id, form_url, context)

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._confirmed(
            request,
            object_id,
            verb="cancel",
            question="Cancel this run?",
            consequence="It stops at its next step boundary and frees its slots at once; its children are cancelled too.",
            perform=self.cancel,
        )

    def retry_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._confirmed(
            request,
            object_id,
            verb="retry",
            question="Retry this run?",
            consequence="It starts again under its workflow's quota (refused if the key is full); "
            "its journal is kept and the failed step that ended it runs again.",
            perform=self.retry,
        )

    def _confirmed(
        self, request: HttpRequest, object_id: str, *, verb: str, question: str, consequence: str, perform: Any
    ) -> HttpResponse:
        """GET: a confirmation page. POST (with the CSRF token): ``perform`` on the run, then back to its page.

        Requires the permission the changelist actions require ("change workflow run").
        """
        if not self.has_change_permission(request):
            raise PermissionDenied
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404(f"No run with primary key {object_id!r}.")
        change_url = reverse("admin:durable_workflowrun_change", args=[quote(run.pk)])
        if request.method == "POST":
            perform(request, [run])
            return HttpResponseRedirect(change_url)
        context = {
            **self.admin_site.each_context(request),
            "title": f"{verb.capitalize()} run {run.run_id}?",
            "opts": self.opts,
            "run": run,
            "keys": sorted(t for t in run.tags.values_list("tag", flat=True) if t.startswith(TAG_PREFIX)),
            "verb": verb,
            "question": question,
            "consequence": consequence,
            "change_url": change_url,
        }
        return TemplateResponse(request, "admin/durable/workflowrun/confirm.html", context)

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

    @admin.display(description="replaced by")
    def replaced_by(self, obj: models.WorkflowRun) -> str:
        """The run that replaced this queued one (CANCEL_QUEUED_EXCEPT_NEWEST), linked."""
        run_id = obj.error.get("replaced_by") if isinstance(obj.error, dict) else None
        if not isinstance(run_id, str):
            return "—"
        pk = models.WorkflowRun.objects.filter(run_id=run_id).values_list("pk", flat=True).first()
        if pk is None:
            return run_id  # purged since
        return format_html('<a href="{}">{}</a>', reverse("admin:durable_workflowrun_change", args=[pk]), run_id)

    created = time_column("created_at", "created")
    dispatched = time_column("dispatched_at", "dispatched")
    started = time_column("started_at", "started")
    heartbeat = time_column("heartbeat_at", "heartbeat")
    updated = time_column("updated_at", "updated")
    finished = time_column("finished_at", "finished")
    wake = time_column("wake_at", "wakes at")
    created_short = time_column("created_at", "created", compact=True)
    finished_short = time_column("finished_at", "finished", compact=True)

    @admin.display(description="workflow", ordering="workflow")
    def workflow_version(self, run: models.WorkflowRun) -> SafeString:
        namespace = (
            format_html('<br><span class="durable-quiet">namespace {}</span>', run.namespace)
            if run.namespace != "default"
            else ""
        )
        return format_html("{} v{}{}", run.workflow, run.version, namespace)

    @admin.display(description="status", ordering="status")
    def status_mark(self, run: models.WorkflowRun) -> SafeString:
        attempt = format_html('<br><span class="durable-quiet">attempt {}</span>', run.attempt) if run.attempt > 1 else ""
        return format_html('<span class="durable-status durable-status-{}">{}</span>{}', run.status, run.status, attempt)

    @admin.display(description="keys")
    def keys(self, run: models.WorkflowRun) -> SafeString | str:
        """The run's concurrency keys (read for the whole page at once by the changelist)."""
        found = getattr(run, "concurrency_keys", None)
        if found is None:
            found = [t[len(TAG_PREFIX) :] for t in run.tags.filter(tag__startswith=TAG_PREFIX).values_list("tag", flat=True)]
        links = ((reverse("admin:durable_concurrencylock_change", args=[quote(key)]), key) for key in found)
        return format_html_join(mark_safe("<br>"), '<a class="durable-keys" href="{}">{}</a>', links)

    @admin.display(description="took")
    def took(self, run: models.WorkflowRun) -> SafeString:
        return format_html('<span class="durable-took">{}</span>', run_duration(run))

    @admin.display(description="now")
    def current_step(self, run: models.WorkflowRun) -> SafeString | str:
        """What an unfinished run is doing, from its journal and status.

        The journal records a step when it finishes, not when it begins: a
        running run executes the step after its last journaled one (the
        position is known, its name only once it is journaled).
        """
        if run.status in TERMINAL_STATUSES:
            return ""
        last = run.steps.order_by("-position").only("position", "name", "finished_at").first()
        after = format_html(', after step #{} "{}"', last.position, last.name) if last else ", its first"
        if run.status == RunStatus.RUNNING:
            # When the executing step began is not stored: say when the journal last moved.
            since: SafeString | str
            if last is not None and last.finished_at is not None:
                since = format_html("step #{} finished {} ago", last.position, age(last.finished_at))
            else:
                since = format_html("the run started {} ago", age(run.started_at)) if run.started_at else ""
            return format_html(
                '<span class="durable-current">&#9654; executing step #{}{} ({}; worker {}); '
                "its name is journaled when it finishes</span>",
                last.position + 1 if last else 0,
                after,
                since,
                run.worker or "unknown",
            )
        if run.status == RunStatus.SUSPENDED:
            wakes = format_html(", wakes in {}", duration(run.wake_at - timezone.now())) if run.wake_at else ""
            return format_html(
                '<span class="durable-current">suspended at step #{}: waiting for {}{}</span>',
                last.position if last else 0,
                run.waiting_for or "?",
                wakes,
            )
        if run.status == RunStatus.QUEUED:
            return format_html('<span class="durable-current">queued for a slot of its key for {}</span>', age(run.created_at))
        if run.status == RunStatus.BLOCKED:
            return format_html(
                '<span class="durable-current">blocked: no live worker serves queue {}</span>', run.queue or "default"
            )
        return format_html(
            '<span class="durable-current">pending: waiting for a worker to pick it up (next step #{})</span>',
            last.position + 1 if last else 0,
        )

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
        self.cancel(request, _selected(queryset))

    @admin.action(description="Retry selected runs", permissions=["change"])
    def retry_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Start failed, dead and cancelled runs again (oldest first), each under its quota."""
        self.retry(request, _selected(queryset))

    def cancel(self, request: HttpRequest, runs: Sequence[models.WorkflowRun]) -> None:
        """Cancel ``runs`` through the engine and say what happened (the action and the button)."""
        engine = self.get_engine()
        cancelled: list[str] = []
        finished: list[str] = []
        missing: list[str] = []
        for run in runs:
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

    def retry(self, request: HttpRequest, runs: Sequence[models.WorkflowRun]) -> None:
        """Retry ``runs`` through the engine, each under its quota, and say what happened."""
        engine = self.get_engine()
        retried: list[str] = []
        not_retryable: list[str] = []
        refused: list[str] = []
        missing: list[str] = []
        for run in runs:
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
