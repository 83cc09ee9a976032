"""The concurrency quotas admin: one row per key, read-only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

from durable import models, quotas
from durable.admin.display import runs_with_tag_url
from durable.admin.listing import EstimatedCountPaginator
from durable.concurrency import TAG_PREFIX


class _QuotaChangeList(ChangeList):
    """Attaches each listed key's ``QuotaInfo`` (``quota_info``) to its row.

    ``quotas.infos_for()`` computes the page's keys only, in one grouped query, so
    a page costs the same number of queries whatever its length and however many
    other keys there are.
    """

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        page = list(self.result_list)  # fills the page's result cache
        infos = {info.key: info for info in quotas.infos_for(page)}
        for lock in page:
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
    paginator = EstimatedCountPaginator
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
        return format_html('<a href="{}">runs of this key</a>', runs_with_tag_url(TAG_PREFIX + lock.key))
