"""How durable's errors become HTTP responses.

``exception_handler`` is a drop-in replacement for DRF's
``rest_framework.views.exception_handler``::

    REST_FRAMEWORK = {"EXCEPTION_HANDLER": "durable.api.exception_handler"}

It answers durable's errors itself and hands everything else to DRF's default
handler, so a project's own views that call ``Wf.dispatch(...)`` answer 429 (with
``Retry-After``, like DRF's ``Throttled``) instead of 500 when a quota is full.
"""

from __future__ import annotations

from typing import Any

from rest_framework import views as drf_views
from rest_framework.response import Response

from durable import http


def durable_error_response(exc: BaseException) -> Response | None:
    """The response for one of durable's errors (``durable.http.error_parts``: the
    same status, body and headers a plain Django view answers with), or None."""
    parts = http.error_parts(exc)
    if parts is None:
        return None
    status, data, headers = parts
    # Like DRF's own handler: roll back ATOMIC_REQUESTS work of the failed request.
    drf_views.set_rollback()
    return Response(data, status=status, headers=headers)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's exception handler, plus durable's errors.

    ``ConcurrencyLimitError`` (and ``ConcurrencyQueueFullError``) -> 429 with
    ``Retry-After`` and ``{"detail", "code", "workflow", "key", "limit", "active", "retry_after"}``
    (plus ``queued`` and ``max_queued`` for a full queue; ``source``, ``pool``,
    ``pool_limit``, ``pool_active``, ``up_to`` and ``borrowed`` for a key with a burst);
    ``InvalidStartError`` and ``InvalidScheduleError`` -> 400; ``UnknownWorkflowError``,
    ``RunNotFound`` and ``ScheduleNotFound`` -> 404;
    ``RunTerminalError`` and ``RunIdTaken`` -> 409, each with ``{"detail", "code"}``. Anything else
    goes to ``rest_framework.views.exception_handler``.
    """
    response = durable_error_response(exc)
    if response is not None:
        return response
    return drf_views.exception_handler(exc, context)
