"""Small helpers shared by the engine and the API."""

from __future__ import annotations

import contextlib
import json
import re
import traceback as _traceback
from typing import Any

from durable import exceptions
from durable.conf import settings

#: An escaped NUL in JSON text (not an escaped backslash followed by "u0000").
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def check_json(value: Any, *, what: str) -> Any:
    """Return ``value`` as it will be stored (a JSON round trip), or raise ``InvalidStartError``.

    Beyond ``json.dumps``: text must be valid UTF-8 without NUL characters (which
    PostgreSQL's jsonb cannot hold), and nesting is bounded.
    """
    what = what[:1].upper() + what[1:]
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")  # lone surrogates raise here
    except (TypeError, ValueError, RecursionError) as exc:
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise exceptions.InvalidStartError(f"{what} must be a JSON value: {reason}.") from exc
    # The substring first: the pattern, tried at every position, took 0.5 ms for 8 KB of text.
    if "\\u0000" in text and _NUL.search(text):
        raise exceptions.InvalidStartError(f"{what} must be a JSON value without NUL (\\u0000) characters.")
    return json.loads(text)


def describe_error(exc: BaseException, *, with_args: bool = False, with_traceback: bool = False) -> dict[str, Any]:
    """``{"type": "<module>.<qualname>", "message": ...}`` of an exception, storable
    as JSON. ``with_args`` adds ``"args"`` when the exception's arguments are JSON
    values (a replay rebuilds the exception from them, see ``WorkflowContext.step``).
    ``with_traceback`` adds ``"traceback"`` (``format_traceback``) unless the
    ``TRACEBACK_LIMIT`` setting is 0."""
    error: dict[str, Any] = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": storable_text(str(exc)),
    }
    if with_args:
        with contextlib.suppress(exceptions.InvalidStartError):
            error["args"] = check_json(list(exc.args), what="the arguments of an exception")
    if with_traceback:
        text = format_traceback(exc)
        if text:
            error["traceback"] = text
    return error


def format_traceback(exc: BaseException, limit: int | None = None) -> str:
    """The traceback of ``exc`` as text, at most ``limit`` characters (default: the
    ``TRACEBACK_LIMIT`` setting; 0: ""). A longer one keeps its end, the frames
    nearest the raise and the exception line, after a line saying how much was cut.
    The text is storable as JSON: no NUL, no lone surrogates."""
    limit = int(settings.TRACEBACK_LIMIT) if limit is None else limit
    if limit <= 0:
        return ""
    try:
        text = "".join(_traceback.format_exception(exc))
    except Exception:  # a __str__ that raises: the frames without the message
        text = "".join(_traceback.format_tb(exc.__traceback__)) + f"{type(exc).__qualname__}: <unprintable>\n"
    text = storable_text(text)
    if len(text) > limit:
        keep = limit - len(_TRUNCATED.format(len(text)))  # the marker is never longer than that
        text = _TRUNCATED.format(len(text) - keep) + text[-keep:] if keep > 0 else text[-limit:]
    return text


def storable_text(text: str) -> str:
    """``text`` with what PostgreSQL's jsonb cannot hold, NUL and lone surrogates,
    written as backslash escapes (``\\x00``, ``\\ud800``)."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


_TRUNCATED = "[traceback truncated: its first {} characters are left out]\n"
