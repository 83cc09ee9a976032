from __future__ import annotations

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class DurableConfig(AppConfig):
    name = "durable"
    verbose_name = "Durable workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from durable import checks  # noqa: F401  (registers the system checks)

        # Import <app>/workflows.py of every installed app, like admin.autodiscover().
        autodiscover_modules("workflows")
