"""System checks for misconfiguration."""

from __future__ import annotations

import difflib
from typing import Any

from django.conf import settings as django_settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from durable import concurrency, conf, retention


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
        close = difflib.get_close_matches(str(name), sorted(conf.setting_names()), n=1)
        errors.append(
            checks.Error(
                f"DURABLE[{name!r}] is not a durable setting.",
                hint=(f"Did you mean {close[0]!r}? " if close else "")
                + 'The settings are listed on the "Settings" page of durable\'s reference documentation.',
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
    for name in ("TRACEBACK_LIMIT", "PROMETHEUS_ACTIVE_RUNS_KEYS"):
        value = getattr(conf.settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            errors.append(
                checks.Error(
                    f"DURABLE[{name!r}] must be a whole number, 0 or more; it is {value!r}.",
                    hint="0 turns it off; see the Settings page of durable's reference documentation.",
                    id="durable.E003",
                )
            )
    interval = conf.settings.PUBLISH_BATCH_INTERVAL
    if not conf.valid_batch_interval(interval):
        errors.append(
            checks.Error(
                f"DURABLE['PUBLISH_BATCH_INTERVAL'] must be a number of seconds from 0 to "
                f"{conf.MAX_PUBLISH_BATCH_INTERVAL:g}; it is {interval!r}.",
                hint="0 publishes each message as soon as the publisher's thread gets to it; "
                f"the publisher uses the default ({conf.Defaults.PUBLISH_BATCH_INTERVAL:g}) meanwhile.",
                id="durable.E005",
            )
        )
    try:
        retention.retention_policy()
    except ImproperlyConfigured as exc:
        errors.append(
            checks.Error(
                str(exc),
                hint="Set it to None, one duration such as '30d', or a dictionary by finished status such as "
                "{'completed': '7d', 'failed': '90d'} (durations: a whole number followed by d, h, m or s).",
                id="durable.E004",
            )
        )
    errors.extend(_check_pools())
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


def _check_pools() -> list[checks.CheckMessage]:
    """``DURABLE["POOLS"]``: ``{pool name: limit}`` (what ``Burst(pool=...)`` names)."""
    pools = conf.settings.POOLS
    if pools is None:
        return []
    hint = "Declare each pool with its limit, for example DURABLE['POOLS'] = {'global': 50}."
    if not isinstance(pools, dict):
        return [checks.Error(f"DURABLE['POOLS'] must be a dictionary; it is {pools!r}.", hint=hint, id="durable.E010")]
    errors: list[checks.CheckMessage] = []
    for name, limit in pools.items():
        if not isinstance(name, str) or not name or len(name) > concurrency.MAX_KEY_LENGTH:
            errors.append(checks.Error(f"DURABLE['POOLS'] has an invalid pool name {name!r}.", hint=hint, id="durable.E010"))
        elif isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= concurrency.MAX_LIMIT:
            errors.append(
                checks.Error(
                    f"The limit of pool {name!r} in DURABLE['POOLS'] must be a whole number, 0 or more; it is {limit!r}.",
                    hint=hint,
                    id="durable.E010",
                )
            )
    return errors


#: Content types that let a message run code when it is read (Celery's pickle and YAML's unsafe loader).
_UNSAFE_CONTENT = {"pickle", "application/x-python-serialize", "yaml", "application/x-yaml"}


@checks.register()
def check_celery(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """What breaks durable at run time in the project's Celery app (``celery.current_app``)."""
    from celery import current_app

    from durable import tasks

    app = current_app
    registered = app.tasks  # finalizes the app: its tasks, annotations and beat schedule are set
    conf = app.conf
    errors: list[checks.CheckMessage] = []
    accepted = {str(content).lower() for content in conf.accept_content or ()}
    unsafe = sorted(accepted & _UNSAFE_CONTENT)
    if unsafe or str(conf.task_serializer).lower() != "json":
        errors.append(
            checks.Warning(
                f"The Celery app {app.main!r} serializes tasks with {conf.task_serializer!r} and accepts "
                f"{sorted(accepted)}: a message in {', '.join(unsafe) or 'a format other than JSON'} can run code "
                "when a worker reads it, and durable sends JSON only.",
                hint="Set CELERY_TASK_SERIALIZER = 'json' and CELERY_ACCEPT_CONTENT = ['json'] "
                "(and the result serializer likewise).",
                id="durable.W002",
            )
        )
    for name in (tasks.EXECUTE_TASK, tasks.WAKE_TASK, tasks.FIRE_SCHEDULE_TASK):
        task = registered.get(name)
        if task is not None and not (task.acks_late and task.reject_on_worker_lost):
            errors.append(
                checks.Warning(
                    f"Celery task {name!r} is not acknowledged late (acks_late={task.acks_late!r}, "
                    f"reject_on_worker_lost={task.reject_on_worker_lost!r}): a worker that dies while it runs loses "
                    "its message, and the run waits for the sweeper instead of being delivered again at once.",
                    hint="Remove the task_annotations (or task_acks_late / task_reject_on_worker_lost settings) "
                    "that turn these off for durable's tasks.",
                    id="durable.W003",
                )
            )
    schedule = conf.beat_schedule or {}
    if not any(isinstance(entry, dict) and entry.get("task") == tasks.SWEEP_TASK for entry in schedule.values()):
        errors.append(
            checks.Warning(
                f"The Celery app {app.main!r} has no beat entry for {tasks.SWEEP_TASK!r}: runs whose worker died, "
                "lost messages and due timers wait until something sweeps.",
                hint="Merge durable.tasks.beat_schedule() into app.conf.beat_schedule and run celery beat "
                "(or silence durable.W004 if a PeriodicTask of durable.sweep is kept in the database instead).",
                id="durable.W004",
            )
        )
    return errors
