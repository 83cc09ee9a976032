"""Pagination of the API's lists: ``?page=N``, ``DURABLE["API_PAGE_SIZE"]`` items a page."""

from __future__ import annotations

from rest_framework import pagination
from rest_framework.request import Request

from durable.conf import settings


class PageNumberPagination(pagination.PageNumberPagination):
    def get_page_size(self, request: Request) -> int:
        # Read per request (not a class attribute) so override_settings applies.
        return max(1, int(settings.API_PAGE_SIZE))
