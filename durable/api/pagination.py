"""Pagination of the API's lists, ``DURABLE["API_PAGE_SIZE"]`` items a page.

Runs and quotas are paged by cursor (``?cursor=``, the ``next`` and ``previous``
links): a page is one index range read from where the previous one stopped, and
nothing counts the whole list, so a page costs the same with a thousand rows or
a million. Schedules, a short list, are paged by number (``?page=N``, with ``count``).
"""

from __future__ import annotations

from rest_framework import pagination
from rest_framework.request import Request

from durable.conf import settings


def _page_size() -> int:
    # Read per request (not a class attribute) so override_settings applies.
    return max(1, int(settings.API_PAGE_SIZE))


class PageNumberPagination(pagination.PageNumberPagination):
    def get_page_size(self, request: Request) -> int:
        return _page_size()


class RunCursorPagination(pagination.CursorPagination):
    """Newest first; the ordering the ``durable_run_created_idx`` and
    ``durable_run_status_idx`` indexes serve (ties on ``created_at`` broken by id)."""

    ordering = ("-created_at", "-id")

    def get_page_size(self, request: Request) -> int:
        return _page_size()


class QuotaCursorPagination(pagination.CursorPagination):
    """By key: the primary key of ``ConcurrencyLock``, unique, so the cursor is exact."""

    ordering = ("key",)

    def get_page_size(self, request: Request) -> int:
        return _page_size()
