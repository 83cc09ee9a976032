"""Namespace functions for ``DURABLE["API_NAMESPACE"]`` in the API tests."""

from __future__ import annotations

from typing import Any


def by_username(request: Any) -> str | None:
    """``tenant-<username>``; None (refused) for the user named ``nobody``."""
    username = request.user.get_username()
    return None if username == "nobody" else f"tenant-{username}"


def broken(request: Any) -> Any:
    return 42
