from __future__ import annotations

import importlib
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.utils.module_loading import autodiscover_modules


class DurableConfig(AppConfig):
    name = "durable"
    verbose_name = "Durable workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from durable import checks  # noqa: F401  (registers the system checks)

        # Import <app>/workflows.py of every installed app, like admin.autodiscover().
        autodiscover_modules("workflows")
        _import_task_backends()


def _import_task_backends() -> None:
    """Import the module of every durable backend the ``TASKS`` setting names
    (``durable.contrib.tasks``), so the workflow its runs are runs of is registered
    in every process, Celery workers included, before any task is enqueued."""
    configured: Any = getattr(settings, "TASKS", None)
    if not isinstance(configured, dict):
        return
    for params in configured.values():
        backend = params.get("BACKEND") if isinstance(params, dict) else None
        if isinstance(backend, str) and backend.startswith("durable."):
            importlib.import_module(backend.rpartition(".")[0])
