"""durable.contrib.prometheus: the counters, the histogram and the active-runs gauges after real runs."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="the [prometheus] extra is not installed")

from django.apps import apps  # noqa: E402

from durable import Concurrency, ConcurrencyLimitError, DjangoStore, Engine, RunStatus, Strategy, signals  # noqa: E402
from durable.runtime import Registry  # noqa: E402

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def metrics() -> Iterator[Any]:
    from durable.contrib.prometheus import metrics

    metrics.connect()
    yield metrics
    metrics.disconnect()


@pytest.fixture
def queued(store: Any) -> Engine:
    return Engine(store, dispatch=lambda engine, run: None, registry=Registry())


def value(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def explode() -> None:
    raise ValueError("no")


def test_starts_and_finished_runs_are_counted_per_workflow(metrics: Any, queued: Engine) -> None:
    name = f"prom.{uuid.uuid4().hex[:8]}"  # a workflow of this test's own: its series start at 0
    spec = Concurrency(key=f"{name}:k", limit=1, strategy=Strategy.GROUP_ROUND_ROBIN, max_queued=1)
    queued.register(name, "1", lambda ctx, input: ctx.step("fail", explode) if input == "fail" else "ok", spec)
    first = queued.start(name, "fail")
    second = queued.start(name, "ok")  # queued behind the first
    with pytest.raises(ConcurrencyLimitError):
        queued.start(name, "ok")  # the queue is full
    assert second.status == RunStatus.QUEUED
    assert [value("durable_starts_total", workflow=name, outcome=o) for o in ("admitted", "queued", "refused")] == [1, 1, 1]

    queued.execute(first.run_id)  # fails, and hands its slot to the second
    queued.execute(second.run_id)
    third = queued.start(name, "ok")
    queued.cancel(third.run_id)  # never ran: counted, but no duration

    finished = {s: value("durable_runs_finished_total", workflow=name, status=s) for s in ("completed", "failed", "cancelled")}
    assert finished == {"completed": 1, "failed": 1, "cancelled": 1}
    assert value("durable_run_duration_seconds_count", workflow=name) == 2
    assert value("durable_run_duration_seconds_sum", workflow=name) >= 0
    assert value("durable_run_duration_seconds_bucket", workflow=name, le="+Inf") == 2
    assert value("durable_starts_total", workflow=name, outcome="admitted") == 2

    exposition = prometheus_client.generate_latest().decode()
    assert f'durable_runs_finished_total{{status="failed",workflow="{name}"}} 1.0' in exposition


def test_django_prometheus_metrics_view_exports_them(metrics: Any, queued: Engine) -> None:
    """django-prometheus's ``/metrics`` view (``ExportToDjangoView``) serves the default
    registry, so durable's series appear there with nothing else to configure."""
    exports = pytest.importorskip("django_prometheus.exports", reason="django-prometheus is not installed")
    from django.test import RequestFactory

    name = f"prom.{uuid.uuid4().hex[:8]}"
    queued.register(name, "1", lambda ctx, input: None)
    queued.execute(queued.start(name).run_id)
    response = exports.ExportToDjangoView(RequestFactory().get("/metrics"))
    assert response.status_code == 200
    body = response.content.decode()
    assert f'durable_starts_total{{outcome="admitted",workflow="{name}"}} 1.0' in body
    assert f'durable_runs_finished_total{{status="completed",workflow="{name}"}} 1.0' in body
    assert f'durable_run_duration_seconds_count{{workflow="{name}"}} 1.0' in body


def test_a_start_created_cancelled_is_counted(metrics: Any, queued: Engine) -> None:
    name = f"prom.{uuid.uuid4().hex[:8]}"
    queued.register(name, "1", lambda ctx, input: None, Concurrency(key=f"{name}:k", limit=1, strategy=Strategy.CANCEL_NEWEST))
    queued.start(name)
    queued.start(name)
    assert value("durable_starts_total", workflow=name, outcome="cancelled") == 1
    assert value("durable_runs_finished_total", workflow=name, status="cancelled") == 1


def test_disconnected_metrics_do_not_move(queued: Engine) -> None:
    from durable.contrib.prometheus import metrics

    metrics.connect()
    metrics.disconnect()
    name = f"prom.{uuid.uuid4().hex[:8]}"
    queued.register(name, "1", lambda ctx, input: None)
    queued.execute(queued.start(name).run_id)
    assert value("durable_starts_total", workflow=name, outcome="admitted") == 0
    assert not signals.run_finished.has_listeners(queued)


def test_the_active_runs_gauges_read_the_lock_table_when_enabled(metrics: Any, settings: Any) -> None:
    engine = Engine(DjangoStore(), dispatch=lambda engine, run: None, registry=Registry())
    spec = Concurrency(key=lambda input: input, limit=2, strategy=Strategy.GROUP_ROUND_ROBIN)
    engine.register("prom.gauge", "1", lambda ctx, input: None, spec)
    for key in ("a:1", "a:1", "a:1", "b:2"):
        engine.start("prom.gauge", key)

    # Off by default: no query at scrape time.
    assert prometheus_client.REGISTRY.get_sample_value("durable_quota_active_runs", {"key": "a:1"}) is None
    settings.DURABLE = {**settings.DURABLE, "PROMETHEUS_ACTIVE_RUNS_KEYS": 10}
    assert value("durable_quota_active_runs", key="a:1") == 2
    assert value("durable_quota_queued_runs", key="a:1") == 1
    assert value("durable_quota_limit", key="a:1") == 2
    assert value("durable_quota_active_runs", key="b:2") == 1
    assert value("durable_quota_keys") == 2

    settings.DURABLE = {**settings.DURABLE, "PROMETHEUS_ACTIVE_RUNS_KEYS": 1}  # a cut list, in key order
    assert value("durable_quota_active_runs", key="a:1") == 2
    assert prometheus_client.REGISTRY.get_sample_value("durable_quota_active_runs", {"key": "b:2"}) is None
    assert value("durable_quota_keys") == 2


def test_the_app_config_connects_the_receivers() -> None:
    from durable.contrib.prometheus import apps as prometheus_apps
    from durable.contrib.prometheus import metrics

    config = prometheus_apps.PrometheusConfig("durable.contrib.prometheus", importlib.import_module("durable.contrib.prometheus"))
    assert config.label == "durable_prometheus" and not apps.is_installed("durable.contrib.prometheus")
    config.ready()
    try:
        assert signals.run_finished.has_listeners() and signals.start_refused.has_listeners()
        config.ready()  # idempotent: one receiver each, one collector
        assert len(signals.run_finished.receivers) == 1
    finally:
        metrics.disconnect()
    assert not signals.run_finished.has_listeners()


def test_the_app_without_prometheus_client_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from django.core.exceptions import ImproperlyConfigured

    from durable.contrib.prometheus import apps as prometheus_apps

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client raises ImportError
    monkeypatch.delitem(sys.modules, "durable.contrib.prometheus.metrics", raising=False)
    monkeypatch.delattr(importlib.import_module("durable.contrib.prometheus"), "metrics", raising=False)
    config = prometheus_apps.PrometheusConfig("durable.contrib.prometheus", importlib.import_module("durable.contrib.prometheus"))
    with pytest.raises(ImproperlyConfigured, match=r"pip install 'django-durable-workflows\[prometheus\]'"):
        config.ready()
    assert not signals.run_finished.has_listeners()
