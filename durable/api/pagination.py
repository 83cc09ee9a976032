"""Pagination of the API's lists, ``DURABLE["API_PAGE_SIZE"]`` items a page.

Runs and quotas are paged by cursor (``?cursor=``, the ``next`` and ``previous``
links): a page is one index range read from where the previous one stopped, and
nothing counts the whole list, so a page costs the same with a thousand rows or
a million. Schedules, a short list, are paged by number (``?page=N``, with ``count``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from django.db.models import DateTimeField, Q, Subquery, Value
from django.db.models.functions import Coalesce
from rest_framework import pagination
from rest_framework.exceptions import NotFound
from rest_framework.request import Request

from durable.conf import settings


def _page_size() -> int:
    # Read per request (not a class attribute) so override_settings applies.
    return max(1, int(settings.API_PAGE_SIZE))


class PageNumberPagination(pagination.PageNumberPagination):
    def get_page_size(self, request: Request) -> int:
        return _page_size()


class RunCursorPagination(pagination.CursorPagination):
    """Newest first, by ``(created_at, id)``: the order of the ``durable_run_created_idx``
    and ``durable_run_status_idx`` indexes.

    The cursor holds the creation time and the id of the row it starts after (or
    before, going back), so runs created in the same instant (one transaction's
    runs share it) are each listed once, in either direction, and a page is an
    index range from that row: ``created_at <= t`` in the index condition (``t``
    read once, by primary key), the few rows of the same instant filtered by id.
    """

    ordering = ("-created_at", "-id")

    def get_page_size(self, request: Request) -> int:
        return _page_size()

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any]:
        self.request = request
        self.base_url = request.build_absolute_uri()
        self.page_size = self.get_page_size(request)
        self.cursor = self.decode_cursor(request)  # NotFound("Invalid cursor") for a bad one
        forward = self.cursor is None or not self.cursor.reverse
        if self.cursor is not None:
            created_at, pk = self._position(self.cursor.position)
            # The row's own stored time (the cursor's if the row is gone): SQLite
            # compares times as text, and the cursor's text may differ from the
            # stored one for the same instant.
            rows_time = queryset.model._default_manager.filter(pk=pk).order_by().values("created_at")[:1]
            anchor = Coalesce(Subquery(rows_time), Value(created_at, output_field=DateTimeField()))
            if forward:
                queryset = queryset.filter(Q(created_at__lte=anchor) & (Q(created_at__lt=anchor) | Q(id__lt=pk)))
            else:
                queryset = queryset.filter(Q(created_at__gte=anchor) & (Q(created_at__gt=anchor) | Q(id__gt=pk)))
        rows = list(queryset.order_by(*(("-created_at", "-id") if forward else ("created_at", "id")))[: self.page_size + 1])
        more = len(rows) > self.page_size
        page = rows[: self.page_size]
        if not forward:
            page.reverse()
        given = None if self.cursor is None else str(self.cursor.position)
        # Where the next (older) and the previous (newer) pages start; None at either end.
        self.next_position: str | None
        self.previous_position: str | None
        if forward:
            self.next_position = _encode(page[-1]) if more else None
            self.previous_position = None if given is None else (_encode(page[0]) if page else given)
        else:
            self.next_position = _encode(page[-1]) if page else given
            self.previous_position = _encode(page[0]) if more else None
        self.page = page
        return page

    def get_next_link(self) -> str | None:
        if self.next_position is None:
            return None
        return self._link(reverse=False, position=self.next_position)

    def get_previous_link(self) -> str | None:
        if self.previous_position is None:
            return None
        return self._link(reverse=True, position=self.previous_position)

    def _link(self, *, reverse: bool, position: str) -> str:
        cursor: Any = pagination.Cursor(offset=0, reverse=reverse, position=cast(Any, position))
        return str(self.encode_cursor(cursor))

    def _position(self, position: object) -> tuple[datetime, int]:
        try:
            created, pk = str(position).split("|")
            created_at = datetime.fromisoformat(created)
            if created_at.tzinfo is None:
                raise ValueError(position)
            return created_at, int(pk)
        except ValueError:
            raise NotFound(self.invalid_cursor_message) from None


def _encode(run: Any) -> str:
    """A cursor position: the run's creation time and id."""
    return f"{run.created_at.isoformat()}|{run.pk}"


class QuotaCursorPagination(pagination.CursorPagination):
    """By key: the primary key of ``ConcurrencyLock``, unique, so the cursor is exact."""

    ordering = ("key",)

    def get_page_size(self, request: Request) -> int:
        return _page_size()
