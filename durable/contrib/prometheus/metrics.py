"""The metrics, and the receivers that feed them from ``durable.signals``.

Counters and the histogram are updated in the process where the event happens:
starts and refusals where runs are started (web processes, workers starting
children), finished runs mostly in workers. The active-runs gauges are read
from the database at scrape time, and only when ``PROMETHEUS_ACTIVE_RUNS_KEYS``
is more than 0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from durable import signals
from durable.conf import settings
from durable.status import RunStatus

logger = logging.getLogger(__name__)

#: Starts by outcome: ``admitted`` (created pending), ``queued`` (created queued,
#: waiting for a slot), ``cancelled`` (created cancelled: CANCEL_NEWEST,
#: CANCEL_QUEUED_EXCEPT_OLDEST) and
#: ``refused`` (``ConcurrencyLimitError``, nothing created; a refused retry too).
STARTS = Counter("durable_starts", "Starts of workflow runs, by outcome.", ["workflow", "outcome"])
#: Runs that reached a terminal status.
RUNS_FINISHED = Counter("durable_runs_finished", "Runs that reached a terminal status.", ["workflow", "status"])
#: From the first claim of a run by a worker to its terminal status (runs that never ran are not observed).
RUN_DURATION = Histogram(
    "durable_run_duration_seconds",
    "Seconds from a run's first execution to its terminal status.",
    ["workflow"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600, float("inf")),
)

_OUTCOMES: dict[str, str] = {RunStatus.PENDING: "admitted", RunStatus.QUEUED: "queued", RunStatus.CANCELLED: "cancelled"}
_UID = "durable.contrib.prometheus"


def _on_created(sender: Any, *, workflow: str, status: str, **kwargs: Any) -> None:
    STARTS.labels(workflow=workflow, outcome=_OUTCOMES.get(status, status)).inc()


def _on_refused(sender: Any, *, workflow: str, **kwargs: Any) -> None:
    STARTS.labels(workflow=workflow, outcome="refused").inc()


def _on_finished(sender: Any, *, workflow: str, status: str, duration: float | None, **kwargs: Any) -> None:
    RUNS_FINISHED.labels(workflow=workflow, status=status).inc()
    if duration is not None:
        RUN_DURATION.labels(workflow=workflow).observe(duration)


class ActiveRunsCollector(Collector):
    """Per concurrency key: the runs in flight (what its quota counts), the runs
    queued and the last limit used, read from the database at each scrape, for
    at most ``PROMETHEUS_ACTIVE_RUNS_KEYS`` keys in key order (0: nothing).

    Each key is a label value: a key per tenant makes a time series per tenant.
    ``durable_quota_keys`` is the number of keys, so a cut list shows."""

    def describe(self) -> Iterable[Any]:
        # Describing without a query: registering the collector reads no database.
        return []

    def collect(self) -> Iterator[Any]:
        max_keys = int(settings.PROMETHEUS_ACTIVE_RUNS_KEYS)
        if max_keys <= 0:
            return
        from durable import models, quotas

        try:
            total = models.ConcurrencyLock.objects.count()
            infos = quotas.infos_for(list(quotas.visible_locks()[:max_keys]))
        except Exception:  # a scrape must answer, even when the database does not
            logger.warning("durable's active-runs gauges could not read the database.", exc_info=True)
            return
        keys = GaugeMetricFamily("durable_quota_keys", "Concurrency keys known (rows of the lock table).")
        keys.add_metric([], total)
        active = GaugeMetricFamily("durable_quota_active_runs", "Runs a concurrency key's quota counts now.", labels=["key"])
        queued = GaugeMetricFamily("durable_quota_queued_runs", "Runs queued for a slot of a concurrency key.", labels=["key"])
        limit = GaugeMetricFamily("durable_quota_limit", "The last limit a start of a concurrency key used.", labels=["key"])
        for info in infos:
            active.add_metric([info.key], info.active)
            queued.add_metric([info.key], info.queued)
            if info.limit is not None:
                limit.add_metric([info.key], info.limit)
        yield from (keys, active, queued, limit)


_collector = ActiveRunsCollector()
_registered = False


def connect() -> None:
    """Connect the receivers (idempotent) and register the gauges' collector in the default registry."""
    global _registered
    signals._run_created.connect(_on_created, dispatch_uid=_UID)
    signals.start_refused.connect(_on_refused, dispatch_uid=_UID)
    signals.run_finished.connect(_on_finished, dispatch_uid=_UID)
    if not _registered:
        REGISTRY.register(_collector)
        _registered = True


def disconnect() -> None:
    """Undo ``connect``: the counters keep their values but no longer move."""
    global _registered
    signals._run_created.disconnect(dispatch_uid=_UID)
    signals.start_refused.disconnect(dispatch_uid=_UID)
    signals.run_finished.disconnect(dispatch_uid=_UID)
    if _registered:
        REGISTRY.unregister(_collector)
        _registered = False
