"""Small helpers shared by the engine and the API."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from durable import exceptions

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
    if _NUL.search(text):
        raise exceptions.InvalidStartError(f"{what} must be a JSON value without NUL (\\u0000) characters.")
    return json.loads(text)


def describe_error(exc: BaseException, *, with_args: bool = False) -> dict[str, Any]:
    """``{"type": "<module>.<qualname>", "message": ...}`` of an exception, storable
    as JSON. ``with_args`` adds ``"args"`` when the exception's arguments are JSON
    values (a replay rebuilds the exception from them, see ``WorkflowContext.step``)."""
    error: dict[str, Any] = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc).replace("\x00", "\\x00"),  # PostgreSQL's jsonb cannot hold NUL
    }
    if with_args:
        with contextlib.suppress(exceptions.InvalidStartError):
            error["args"] = check_json(list(exc.args), what="the arguments of an exception")
    return error
