"""System checks for misconfiguration."""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core import checks
from django.db import connections

from durable import conf


@checks.register(checks.Tags.database, deploy=False)
def check_sqlite_transaction_mode(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for alias in connections:
        db = connections.settings[alias]
        if db["ENGINE"] != "django.db.backends.sqlite3":
            continue
        mode = (db.get("OPTIONS") or {}).get("transaction_mode")
        if str(mode).upper() not in {"IMMEDIATE", "EXCLUSIVE"}:
            errors.append(
                checks.Warning(
                    f"SQLite database {alias!r} does not use transaction_mode IMMEDIATE: "
                    "concurrent starts may exceed a concurrency quota or fail with 'database is locked'.",
                    hint=f"Set DATABASES[{alias!r}]['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
                    id="durable.W001",
                )
            )
    return errors


@checks.register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for name in conf.unknown_settings():
        errors.append(
            checks.Error(
                f"DURABLE[{name!r}] is not a durable setting.",
                hint="See docs/reference/settings.md for the list of settings.",
                id="durable.E001",
            )
        )
    if conf.settings.STALE_AFTER <= conf.settings.HEARTBEAT_INTERVAL * 2:
        errors.append(
            checks.Error(
                "DURABLE['STALE_AFTER'] must be more than twice DURABLE['HEARTBEAT_INTERVAL'], "
                "or live runs are taken over as if their worker had died.",
                id="durable.E002",
            )
        )
    handler = getattr(django_settings, "REST_FRAMEWORK", {}).get("EXCEPTION_HANDLER")
    if handler is not None and "durable" not in str(handler):
        errors.append(
            checks.Info(
                "REST_FRAMEWORK['EXCEPTION_HANDLER'] is not durable.api.exception_handler: "
                "your own views that call dispatch() will answer 500 instead of 429 on a full quota.",
                id="durable.I001",
            )
        )
    return errors
