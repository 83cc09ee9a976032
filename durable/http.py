"""durable's errors as HTTP answers, for a project's plain Django views (sync or async).

``error_response`` answers what durable's DRF exception handler answers, with the
same status, body and ``Retry-After``: a ``ConcurrencyLimitError`` becomes a 429
"busy, retry shortly"::

    async def start_turn(request):
        try:
            handle = await ChatTurn.adispatch({"company": request.user.company_id})
        except durable.DurableError as exc:
            return error_response(exc)
        return JsonResponse({"run_id": handle.run_id}, status=202)
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from django.http import JsonResponse

from durable import conf, exceptions

#: HTTP status of each durable error (most specific class first).
_STATUS_BY_ERROR: tuple[tuple[type[exceptions.DurableError], int], ...] = (
    (exceptions.ConcurrencyLimitError, HTTPStatus.TOO_MANY_REQUESTS),
    (exceptions.InvalidStartError, HTTPStatus.BAD_REQUEST),
    (exceptions.UnknownWorkflowError, HTTPStatus.NOT_FOUND),
    (exceptions.RunNotFound, HTTPStatus.NOT_FOUND),
    (exceptions.InvalidScheduleError, HTTPStatus.BAD_REQUEST),
    (exceptions.ScheduleNotFound, HTTPStatus.NOT_FOUND),
    (exceptions.RunTerminalError, HTTPStatus.CONFLICT),
    (exceptions.RunIdTaken, HTTPStatus.CONFLICT),
    (exceptions.PoolBusyError, HTTPStatus.SERVICE_UNAVAILABLE),
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


def error_parts(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]] | None:
    """The status, body and headers that answer one of durable's errors, or None
    when ``exc`` is not one of those.

    ``ConcurrencyLimitError`` (and ``ConcurrencyQueueFullError``) -> 429 with
    ``Retry-After`` and ``{"detail", "code", "workflow", "key", "limit", "active", "retry_after"}``
    (plus ``queued`` and ``max_queued`` for a full queue; ``source``, ``pool``,
    ``pool_limit``, ``pool_active``, ``up_to`` and ``borrowed`` for a key with a burst); ``InvalidStartError``
    and ``InvalidScheduleError`` -> 400; ``UnknownWorkflowError``, ``RunNotFound``
    and ``ScheduleNotFound`` -> 404; ``RunTerminalError`` and ``RunIdTaken`` ->
    409, each with ``{"detail", "code"}``; ``PoolBusyError`` -> 503 with
    ``Retry-After`` (``DURABLE["RETRY_AFTER"]``) and ``{"detail", "code"}``.
    """
    if not isinstance(exc, exceptions.DurableError):
        return None
    status = next((status for error_class, status in _STATUS_BY_ERROR if isinstance(exc, error_class)), None)
    if status is None:
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
    elif isinstance(exc, exceptions.PoolBusyError):
        headers["Retry-After"] = str(retry_after())
    return int(status), data, headers


def error_response(exc: BaseException) -> JsonResponse | None:
    """The ``JsonResponse`` for one of durable's errors (see ``error_parts``), or
    None when ``exc`` is not one of those (re-raise it, or answer it yourself)."""
    parts = error_parts(exc)
    if parts is None:
        return None
    status, data, headers = parts
    return JsonResponse(data, status=status, headers=headers)
