"""Small helpers shared by the engine and the API."""

from __future__ import annotations

import json
from typing import Any

from durable import exceptions


def check_json(value: Any, *, what: str) -> Any:
    """Return ``value`` as it will be stored (a JSON round trip), or raise ``InvalidStartError``."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise exceptions.InvalidStartError(f"{what[:1].upper()}{what[1:]} must be a JSON value: {exc}.") from exc


def describe_error(exc: BaseException) -> dict[str, str]:
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)}
