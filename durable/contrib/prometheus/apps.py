from __future__ import annotations

from django.apps import AppConfig


class PrometheusConfig(AppConfig):
    """Connects the metrics' receivers to durable's signals when Django starts."""

    name = "durable.contrib.prometheus"
    label = "durable_prometheus"
    verbose_name = "durable: Prometheus metrics"

    def ready(self) -> None:
        from durable.contrib.prometheus import metrics

        metrics.connect()
