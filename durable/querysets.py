"""The query vocabulary of durable's models."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from django.db import models

from durable.status import ACTIVE_STATUSES, RunStatus


class RunQuerySet(models.QuerySet):
    def active(self) -> RunQuerySet:
        """Runs that have not reached a terminal status."""
        return self.filter(status__in=ACTIVE_STATUSES)

    def in_namespace(self, namespace: str | None) -> RunQuerySet:
        return self if namespace is None else self.filter(namespace=namespace)

    def with_tag(self, tag: str) -> RunQuerySet:
        return self.filter(tags__tag=tag)

    def with_statuses(self, statuses: Iterable[str] | None) -> RunQuerySet:
        return self if statuses is None else self.filter(status__in=list(statuses))

    def orphaned(self, heartbeat_before: datetime) -> RunQuerySet:
        """Running runs whose worker stopped sending heartbeats."""
        return self.filter(status=RunStatus.RUNNING, heartbeat_at__lt=heartbeat_before)

    def undelivered(self, dispatched_before: Sequence[datetime]) -> RunQuerySet:
        """Pending runs whose Celery message no worker picked up in time."""
        return self.filter(status=RunStatus.PENDING).redispatch_due(dispatched_before)

    def redispatch_due(self, dispatched_before: Sequence[datetime], *, first_at_once: bool = False) -> RunQuerySet:
        """Runs whose last message is older than their re-send delay: a run re-sent
        ``n`` times already is due when sent before ``dispatched_before[n]`` (the
        last cutoff holds for every larger ``n``). ``first_at_once``: a run not
        re-sent yet is due whenever it was sent."""
        if not dispatched_before:
            return self
        last = len(dispatched_before) - 1
        due = models.Q(redispatches__gte=last, dispatched_at__lt=dispatched_before[last])
        for n, before in enumerate(dispatched_before[:last]):
            due |= models.Q(redispatches=n) if n == 0 and first_at_once else models.Q(redispatches=n, dispatched_at__lt=before)
        return self.filter(due)


class RunTagQuerySet(models.QuerySet):
    def counting(self, tag: str, statuses: Iterable[str] | None = None) -> RunTagQuerySet:
        """Tag rows of ``tag`` whose run is in ``statuses``: one index range scan."""
        qs = self.filter(tag=tag)
        return qs if statuses is None else qs.filter(status__in=list(statuses))
