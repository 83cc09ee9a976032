from __future__ import annotations

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured


class PrometheusConfig(AppConfig):
    """Connects the metrics' receivers to durable's signals when Django starts."""

    name = "durable.contrib.prometheus"
    label = "durable_prometheus"
    verbose_name = "durable: Prometheus metrics"

    def ready(self) -> None:
        try:
            from durable.contrib.prometheus import metrics
        except ImportError as exc:
            if exc.name != "prometheus_client" and "prometheus_client" not in str(exc):
                raise
            raise ImproperlyConfigured(
                "durable.contrib.prometheus needs prometheus_client: "
                "pip install 'django-durable-workflows[prometheus]', or remove the app from INSTALLED_APPS."
            ) from exc
        metrics.connect()
