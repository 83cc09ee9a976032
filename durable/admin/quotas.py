"""The concurrency quotas admin: a dashboard of the keys, fullest first, read-only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.paginator import InvalidPage
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString

from durable import models, quotas
from durable.admin import usage
from durable.admin.display import age, ago, runs_with_tag_url, timestamp, usage_bar
from durable.admin.listing import EstimatedCountPaginator
from durable.concurrency import TAG_PREFIX, Strategy
from durable.status import ACTIVE_STATUSES, DEFAULT_CONCURRENCY_STATUSES, RunStatus

#: The name the "use" column sorts by (``?o=1`` / ``?o=-1``); not a database column.
USE = "use"
#: How many runs in flight (and queued) a quota's page lists.
RUNS_SHOWN = 50
#: How many changes of its limit a quota's page lists (the newest).
LIMIT_CHANGES_SHOWN = 10


def _in_flight(request: HttpRequest) -> dict[str, usage.InFlight]:
    """``usage.in_flight()``, read once per request (the filters and the order share it)."""
    if not hasattr(request, "_durable_in_flight"):
        request._durable_in_flight = usage.in_flight()  # type: ignore[attr-defined]
    found: dict[str, usage.InFlight] = request._durable_in_flight  # type: ignore[attr-defined]
    return found


class UseFilter(admin.SimpleListFilter):
    """Keys with no free slot, or with runs waiting in their queue."""

    title = "use"
    parameter_name = "use"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("full", "full (no free slot)"), ("queued", "has queued runs")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value not in ("full", "queued"):
            return queryset
        return queryset.filter(usage.keys_where(_in_flight(request), value))


class StrategyFilter(admin.SimpleListFilter):
    """Keys whose runs in flight belong to a workflow declaring a strategy.

    The lock row does not record a strategy (it is declared per workflow, or per
    start): a key is matched through the workflows of its runs in flight, so an
    idle key matches no strategy.
    """

    title = "strategy (of the workflows in flight)"
    parameter_name = "strategy"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(s.value, s.value.replace("_", " ")) for s in Strategy]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value not in {s.value for s in Strategy}:
            return queryset
        return queryset.filter(usage.keys_where(_in_flight(request), value))


class _QuotaChangeList(ChangeList):
    """The keys fullest first (``use`` order, the default), or by key.

    By use: the keys with runs in flight (``usage.in_flight()``, as many as there
    are runs in flight) sorted by how full they are, then the idle keys in key
    order, read a page at a time (``usage.idle``). No step reads every key. Then
    each listed key's ``QuotaInfo`` (``quota_info``): ``quotas.infos_for()``
    computes the page's keys only, in one grouped query.
    """

    by_use: str | None = None

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        order = self.params.get(ORDER_VAR)
        if not order:
            # The default: fullest first.
            self.by_use = "desc"
            return ["key"]
        # The first column sorted by (``o=-1.0``: "use", descending, then "key").
        _, descending, index = order.split(".")[0].rpartition("-")
        if index.isdigit() and int(index) < len(self.list_display) and self.list_display[int(index)] == USE:
            self.by_use = "desc" if descending else "asc"
            return ["key"]
        self.by_use = None
        return super().get_ordering(request, queryset)

    def get_ordering_field(self, field_name: Any) -> Any:
        # "use" is sorted in Python (get_results), never by the database.
        return None if field_name == USE else super().get_ordering_field(field_name)

    def get_ordering_field_columns(self) -> dict[int, Literal["desc", "asc"]]:
        if ORDER_VAR in self.params:
            return super().get_ordering_field_columns()
        # The default order (fullest first) is not a model field: mark its column.
        return {index: "desc" for index, name in enumerate(self.list_display) if name == USE}

    def get_results(self, request: HttpRequest) -> None:
        if self.by_use is None:
            super().get_results(request)
        else:
            self._results_by_use(request)
        page = list(self.result_list)
        infos = {info.key: info for info in quotas.infos_for(page)}
        for lock in page:
            lock.quota_info = infos.get(lock.key)
        self.result_list = page

    def _results_by_use(self, request: HttpRequest) -> None:
        paginator = self.model_admin.get_paginator(request, self.queryset, self.list_per_page)
        result_count = paginator.count
        can_show_all = result_count <= self.list_max_show_all
        multi_page = result_count > self.list_per_page
        in_flight = _in_flight(request)
        busy = sorted(usage.locks_of(self.queryset, in_flight), key=lambda lock: lock.key)
        busy.sort(key=lambda lock: usage.use_order(lock, in_flight[lock.key]), reverse=self.by_use == "desc")
        idle = usage.idle(self.queryset)
        if (self.show_all and can_show_all) or not multi_page:
            rows = busy + list(idle) if self.by_use == "desc" else list(idle) + busy
        else:
            try:
                paginator.validate_number(self.page_num)
            except InvalidPage:
                raise IncorrectLookupParameters from None
            start = (self.page_num - 1) * self.list_per_page
            rows = _page(busy, idle, start, self.list_per_page, busy_first=self.by_use == "desc")
        self.result_count = result_count
        self.show_full_result_count = self.model_admin.show_full_result_count
        self.show_admin_actions = True
        self.full_result_count = None
        self.result_list = rows
        self.can_show_all = can_show_all
        self.multi_page = multi_page
        self.paginator = paginator


def _page(
    busy: list[models.ConcurrencyLock], idle: QuerySet[models.ConcurrencyLock], start: int, size: int, *, busy_first: bool
) -> list[models.ConcurrencyLock]:
    """Rows ``start`` to ``start + size`` of ``busy`` followed by ``idle`` (or ``idle`` then ``busy``)."""
    if busy_first:
        rows = busy[start : start + size]
        if len(rows) < size:
            offset = max(0, start - len(busy))
            rows += list(idle[offset : offset + size - len(rows)])
        return rows
    rows = list(idle[start : start + size])
    if len(rows) < size:
        idle_total = start + len(rows) if rows or start == 0 else idle.count()
        offset = max(0, start - idle_total)
        rows += busy[offset : offset + size - len(rows)]
    return rows


def _info(lock: models.ConcurrencyLock) -> quotas.QuotaInfo | None:
    if not hasattr(lock, "quota_info"):
        # Outside the changelist (the change page): this key's counts only.
        found = quotas.quota_infos(key=lock.key)
        lock.quota_info = found[0] if found else None  # type: ignore[attr-defined]
    info: quotas.QuotaInfo | None = lock.quota_info  # type: ignore[attr-defined]
    return info


def _runs_table(runs: Sequence[models.WorkflowRun], more: int, tag: str, empty: str) -> SafeString | str:
    """A small table of runs (id, workflow, status, age since created), oldest first."""
    if not runs:
        return empty
    now = timezone.now()
    rows = format_html_join(
        "",
        '<tr><td><a href="{}">{}</a></td><td>{}</td><td><span class="durable-status durable-status-{}">{}</span></td>'
        '<td class="durable-duration" title="created {}">{}</td></tr>',
        (
            (
                reverse("admin:durable_workflowrun_change", args=[run.pk]),
                run.run_id,
                run.workflow,
                run.status,
                run.status,
                timestamp(run.created_at),
                age(run.created_at, now),
            )
            for run in runs
        ),
    )
    tail = (
        format_html('<p>and {} more: <a href="{}">all runs of this key</a></p>', more, runs_with_tag_url(tag)) if more > 0 else ""
    )
    return format_html(
        '<table class="durable-runs-table"><thead><tr><th>run</th><th>workflow</th><th>status</th><th>age</th></tr></thead>'
        "<tbody>{}</tbody></table>{}",
        rows,
        tail,
    )


@admin.register(models.ConcurrencyLock)
class ConcurrencyQuotaAdmin(admin.ModelAdmin):
    """Concurrency quotas, one row per key ever used: read-only, fullest first.

    ``limit`` and ``count_statuses`` are the values the latest start of the key
    used, admitted or refused (a limit computed per start may differ from one
    start to the next).
    "use" is the key's runs in those statuses across every namespace over its
    limit, marked FULL when no slot is free; "queued" its queued runs, with how
    long the head of its queue has waited; "oldest in flight" how long ago the
    oldest counted run was created.
    """

    list_display = ("key", USE, "queued", "oldest_queued", "oldest_in_flight", "counted_statuses", "runs")
    list_filter = (UseFilter, StrategyFilter)
    search_fields = ("key",)
    #: The database order of the idle keys; the list itself is fullest first (``_QuotaChangeList``).
    ordering = ("key",)
    show_full_result_count = False
    #: Facet counts would count every key once per filter choice.
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    fields = (
        "key",
        "usage",
        "borrowing",
        "limit_in_effect",
        "limit_changes",
        "active",
        "queued",
        "oldest_queued",
        "oldest_in_flight",
        "statuses_counted",
        "created",
        "runs_in_flight",
        "runs_queued",
        "runs",
    )
    readonly_fields = fields
    empty_value_display = "—"

    class Media:
        css = {"all": ("durable/admin.css",)}

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _QuotaChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # -- columns ------------------------------------------------------------------------
    @admin.display(description="use (active / limit)", ordering=USE)
    def use(self, lock: models.ConcurrencyLock) -> SafeString:
        """The list's column: the bar, and under it a key's burst (or a pool) in short."""
        bar = self.usage(lock)
        info = _info(lock)
        if info is not None and (info.pool is not None or info.is_pool):
            bar = format_html("{}<br>{}", bar, self._burst(info, short=True))
        return bar

    @admin.display(description="use (active / limit)")
    def usage(self, lock: models.ConcurrencyLock) -> SafeString:
        """``active / limit`` as a bar; a key with a burst reads against its ``up_to``
        and is full when a start would find no slot."""
        info = _info(lock)
        if info is not None and info.pool is not None and info.up_to is not None and lock.effective_limit is not None:
            # Beyond its limit a key with a burst borrows, while its pool has room, up to up_to.
            pool_full = info.pool_limit is not None and (info.pool_active or 0) >= info.pool_limit
            full = info.active >= info.up_to or (info.guaranteed >= lock.effective_limit and pool_full)
            bar = usage_bar(info.active, lock.effective_limit, ceiling=info.up_to, full=full)
        else:
            bar = usage_bar(info.active if info else 0, lock.effective_limit)
        if lock.limit_override is None:
            return bar
        return format_html(
            '{} <span class="durable-override" title="set by an operator; the code\'s limit is {}">override</span>',
            bar,
            "unknown" if lock.limit is None else lock.limit,
        )

    @admin.display(description="burst")
    def borrowing(self, lock: models.ConcurrencyLock) -> SafeString | str:
        """A key with a burst: its guaranteed runs over its limit, its borrowed runs over
        what it may borrow (``up_to - limit``), and its pool's use; a pool says so."""
        info = _info(lock)
        if info is None or not (info.pool is not None or info.is_pool):
            return self.get_empty_value_display()
        return self._burst(info, short=False)

    def _burst(self, info: quotas.QuotaInfo, *, short: bool) -> SafeString:
        if info.pool is None:
            return format_html('<span class="durable-burst" title="{}">a pool</span>', "declared in DURABLE['POOLS']")
        limit = info.limit or 0
        borrowable = max(0, (info.up_to or 0) - max(limit, 0))
        pool = format_html(
            'pool <a href="{}">{}</a> {} / {}',
            runs_with_tag_url(TAG_PREFIX + info.pool),
            info.pool,
            "?" if info.pool_active is None else info.pool_active,
            "?" if info.pool_limit is None else info.pool_limit,
        )
        if short:
            return format_html(
                '<span class="durable-burst" title="guaranteed {} of {}, borrowed {} of {}">{} + {} borrowed<br>{}</span>',
                info.guaranteed,
                limit,
                info.borrowed,
                borrowable,
                info.guaranteed,
                info.borrowed,
                pool,
            )
        return format_html(
            "guaranteed {} of {} · borrowed {} of {} (up to {} in all) · {}",
            info.guaranteed,
            limit,
            info.borrowed,
            borrowable,
            info.up_to,
            pool,
        )

    @admin.display(description="active")
    def active(self, lock: models.ConcurrencyLock) -> int:
        info = _info(lock)
        return info.active if info else 0

    @admin.display(description="queued")
    def queued(self, lock: models.ConcurrencyLock) -> SafeString | int:
        info = _info(lock)
        if not info or not info.queued:
            return 0
        return format_html('<span class="durable-queued">{}</span>', info.queued)

    @admin.display(description="longest queued")
    def oldest_queued(self, lock: models.ConcurrencyLock) -> SafeString | str:
        info = _info(lock)
        if info is None or info.oldest_queued_at is None:
            return self.get_empty_value_display()  # a change page shows a None as "None"
        return format_html(
            '<span class="durable-duration" title="queued since {}">waiting {}</span>',
            timestamp(info.oldest_queued_at),
            age(info.oldest_queued_at),
        )

    @admin.display(description="oldest in flight")
    def oldest_in_flight(self, lock: models.ConcurrencyLock) -> SafeString | str:
        info = _info(lock)
        if info is None or info.oldest_active_at is None:
            return self.get_empty_value_display()
        return ago(info.oldest_active_at)

    @admin.display(description="counts")
    def counted_statuses(self, lock: models.ConcurrencyLock) -> SafeString | str:
        """The statuses occupying a slot: "default" for ``DEFAULT_CONCURRENCY_STATUSES`` (listed in its tooltip)."""
        info = _info(lock)
        statuses: Sequence[str] = info.count_statuses if info else (lock.count_statuses or ())
        text = ", ".join(statuses)
        if tuple(statuses) == DEFAULT_CONCURRENCY_STATUSES:
            return format_html('<span title="{}">default</span>', text)
        return text

    @admin.display(description="counted statuses")
    def statuses_counted(self, lock: models.ConcurrencyLock) -> str:
        info = _info(lock)
        return ", ".join(info.count_statuses if info else (lock.count_statuses or ()))

    @admin.display(description="first used")
    def created(self, lock: models.ConcurrencyLock) -> str:
        return timestamp(lock.created_at)

    @admin.display(description="runs")
    def runs(self, lock: models.ConcurrencyLock) -> SafeString:
        return format_html(
            '<a href="{}" title="the runs of this key" style="white-space:nowrap">list runs</a>',
            runs_with_tag_url(TAG_PREFIX + lock.key),
        )

    # -- change page: its limit, who changed it, its runs -----------------------------------
    @admin.display(description="limit")
    def limit_in_effect(self, lock: models.ConcurrencyLock) -> SafeString | str:
        """The limit admission applies: an operator's override, else the code's last known limit."""
        set_url = reverse("admin:durable_limitchange_add") + "?" + urlencode({"key": lock.key})
        if lock.limit_override is None:
            return format_html(
                '{} (from the code) &middot; <a href="{}">override it</a>',
                "unknown until the next start" if lock.limit is None else lock.limit,
                set_url,
            )
        return format_html(
            "<strong>{}</strong>, an operator's override (the code's limit: {}) &middot; <a href=\"{}\">change or clear it</a>",
            lock.limit_override,
            "unknown" if lock.limit is None else lock.limit,
            set_url,
        )

    @admin.display(description="limit changes")
    def limit_changes(self, lock: models.ConcurrencyLock) -> SafeString | str:
        """The latest changes of the key's override: who, when, the limit before and after, why."""
        changes = list(models.LimitChange.objects.filter(key=lock.key).order_by("-changed_at", "-id")[: LIMIT_CHANGES_SHOWN + 1])
        if not changes:
            return "No change: the code's limit has always applied."
        rows = format_html_join(
            "",
            '<tr><td title="{}">{} ago</td><td>{}</td><td>{} &rarr; {}</td><td>{}</td></tr>',
            (
                (
                    timestamp(change.changed_at),
                    age(change.changed_at),
                    change.changed_by_name or "—",
                    "?" if change.old_limit is None else change.old_limit,
                    ("?" if change.new_limit is None else change.new_limit)
                    if change.new_override is not None
                    else format_html("{} (cleared)", "?" if change.new_limit is None else change.new_limit),
                    change.reason,
                )
                for change in changes[:LIMIT_CHANGES_SHOWN]
            ),
        )
        all_url = reverse("admin:durable_limitchange_changelist") + "?" + urlencode({"key": lock.key})
        return format_html(
            '<table class="durable-runs-table"><thead><tr><th>when</th><th>who</th><th>limit</th><th>reason</th></tr></thead>'
            '<tbody>{}</tbody></table><p><a href="{}">{}</a></p>',
            rows,
            all_url,
            "all changes of this key" if len(changes) > LIMIT_CHANGES_SHOWN else "as a list",
        )

    # -- change page: the key's runs --------------------------------------------------------
    @admin.display(description="in flight")
    def runs_in_flight(self, lock: models.ConcurrencyLock) -> SafeString | str:
        info = _info(lock)
        counted = info.count_statuses if info else ()
        statuses = [s for s in counted if s in ACTIVE_STATUSES]
        if len(statuses) == len(counted):
            total = info.active if info else 0
        else:  # a lifetime cap also counts finished runs: those are not listed here
            total = models.RunTag.objects.counting(TAG_PREFIX + lock.key, statuses).count()
        return self._runs_of(lock, statuses, total, "No run in flight.")

    @admin.display(description="queued runs")
    def runs_queued(self, lock: models.ConcurrencyLock) -> SafeString | str:
        info = _info(lock)
        return self._runs_of(lock, [RunStatus.QUEUED], info.queued if info else 0, "No run queued.")

    def _runs_of(self, lock: models.ConcurrencyLock, statuses: Sequence[str], total: int, empty: str) -> SafeString | str:
        """The oldest ``RUNS_SHOWN`` runs of the key in ``statuses`` (an index range on the key's tag)."""
        tag = TAG_PREFIX + lock.key
        found = list(
            models.WorkflowRun.objects.filter(tags__tag=tag, tags__status__in=list(statuses))
            .only("pk", "run_id", "workflow", "status", "created_at")
            .order_by("created_at", "pk")[:RUNS_SHOWN]
        )
        return _runs_table(found, total - len(found), tag, empty)
