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

from rest_framework import status
from rest_framework import views as drf_views
from rest_framework.response import Response

from durable import conf, exceptions

#: HTTP status of each durable error the API answers (most specific class first).
_STATUS_BY_ERROR: tuple[tuple[type[exceptions.DurableError], int], ...] = (
    (exceptions.ConcurrencyLimitError, status.HTTP_429_TOO_MANY_REQUESTS),
    (exceptions.InvalidStartError, status.HTTP_400_BAD_REQUEST),
    (exceptions.UnknownWorkflowError, status.HTTP_404_NOT_FOUND),
    (exceptions.RunNotFound, status.HTTP_404_NOT_FOUND),
    (exceptions.InvalidScheduleError, status.HTTP_400_BAD_REQUEST),
    (exceptions.ScheduleNotFound, status.HTTP_404_NOT_FOUND),
    (exceptions.RunTerminalError, status.HTTP_409_CONFLICT),
    (exceptions.RunIdTaken, status.HTTP_409_CONFLICT),
)

#: Extra fields of a ``ConcurrencyQueueFullError`` copied into the 429 body.
_QUEUE_FIELDS = ("queued", "max_queued")


def retry_after(exc: exceptions.ConcurrencyLimitError | None = None) -> int:
    """The ``Retry-After`` seconds of a 429: the refusal's own estimate
    (``exc.retry_after``), else ``DURABLE["RETRY_AFTER"]`` rounded up, at least 1."""
    seconds = getattr(exc, "retry_after", None)
    if isinstance(seconds, int) and not isinstance(seconds, bool) and seconds >= 1:
        return seconds
    return conf.retry_after_seconds(None)


def durable_error_response(exc: BaseException) -> Response | None:
    """The response for one of durable's errors, or None when ``exc`` is not one."""
    status_code = _status_of(exc)
    if status_code is None or not isinstance(exc, exceptions.DurableError):
        return None
    data: dict[str, Any] = {"detail": str(exc), "code": exc.code}
    headers: dict[str, str] = {}
    if isinstance(exc, exceptions.ConcurrencyLimitError):
        data.update(workflow=exc.workflow, key=exc.key, limit=exc.limit, active=exc.active)
        # ConcurrencyQueueFullError also says how long the key's queue is.
        data.update({name: exc.fields[name] for name in _QUEUE_FIELDS if name in exc.fields})
        # What refused ("limit", or for a key with a burst "pool" / "up_to", with the pool's figures).
        data.update(exc.burst_fields)
        seconds = retry_after(exc)
        data["retry_after"] = seconds
        headers["Retry-After"] = str(seconds)
    # Like DRF's own handler: roll back ATOMIC_REQUESTS work of the failed request.
    drf_views.set_rollback()
    return Response(data, status=status_code, headers=headers)


def _status_of(exc: BaseException) -> int | None:
    for error_class, status_code in _STATUS_BY_ERROR:
        if isinstance(exc, error_class):
            return status_code
    return None


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's exception handler, plus durable's errors.

    ``ConcurrencyLimitError`` (and ``ConcurrencyQueueFullError``) -> 429 with
    ``Retry-After`` and ``{"detail", "code", "workflow", "key", "limit", "active", "retry_after",
    "source"}`` (plus ``queued`` and ``max_queued`` for a full queue; ``pool``,
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
