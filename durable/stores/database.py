"""``DjangoStore``: the store on Django's ORM (PostgreSQL in production, SQLite embedded)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

from django.db import transaction
from django.db.models import CharField, Exists, F, Min, OuterRef, Value
from django.db.models.functions import Concat
from django.utils import timezone

from durable.concurrency import TAG_PREFIX
from durable.status import TERMINAL_STATUSES, RunStatus
from durable.stores import admitting, lifecycle, orm, slots
from durable.stores.base import RunRecord, SlotAnswer


class DjangoStore(admitting.Admission, lifecycle.Lifecycle):
    """Runs, tags, locks and the journal in the project's database.

    ``using`` names the database alias (default ``"default"``). Admission is in
    ``durable.stores.admitting``, a run's state changes and journal in
    ``durable.stores.lifecycle``, step-level quotas in ``durable.stores.slots``;
    here are the reads, the queueing strategies' hand-offs and recovery.
    """

    # -- reads -------------------------------------------------------------
    @orm.reconnecting
    @orm.kept_connection
    def get_run(self, run_id: str) -> RunRecord | None:
        row = self._runs().filter(run_id=run_id).select_related("parent").first()
        return None if row is None else orm.to_record(row)

    @orm.kept_connection
    def settled_run(self, run_id: str) -> RunRecord | None:
        """Read under the row's lock, taken and let go at once: a transaction that holds it
        (a run committing its suspension) ends first, and the row read is what it committed.

        A plain read, and a compare-and-set whose condition the row fails in the statement's
        snapshot, do not wait: PostgreSQL only waits for a row's lock holder when the version
        it sees matches the ``WHERE`` clause."""
        with transaction.atomic(using=self.using):
            row = self._runs().select_for_update(no_key=True, of=("self",)).filter(run_id=run_id).select_related("parent").first()
        return None if row is None else orm.to_record(row)

    @orm.kept_connection
    def list_runs(
        self,
        *,
        workflow: str | None = None,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> list[RunRecord]:
        qs = self._runs().in_namespace(namespace).with_statuses(statuses).select_related("parent")
        if workflow is not None:
            qs = qs.filter(workflow=workflow)
        if tag is not None:
            qs = qs.with_tag(tag)
        return [orm.to_record(row) for row in qs]

    @orm.kept_connection
    def count_runs(
        self,
        *,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> int:
        if tag is None:
            return int(self._runs().in_namespace(namespace).with_statuses(statuses).count())
        qs = self._tags().counting(tag, statuses)
        if namespace is not None:
            qs = qs.filter(namespace=namespace)
        return int(qs.count())

    # -- waiting runs (the sweeper) -----------------------------------------------
    @orm.kept_connection
    def active_children(self, run_id: str) -> list[RunRecord]:
        qs = self._runs().active().filter(parent__run_id=run_id).select_related("parent")
        return [orm.to_record(run) for run in qs]

    def due_runs(self, now: datetime) -> list[RunRecord]:
        qs = self._runs().filter(status=RunStatus.SUSPENDED, wake_at__lte=now).select_related("parent")
        return [orm.to_record(run) for run in qs[:1000]]

    def waiting_parents(self) -> list[RunRecord]:
        ended_child = (
            self._runs()
            .filter(parent=OuterRef("pk"), status__in=TERMINAL_STATUSES)
            .annotate(waited=Concat(Value("child:"), "run_id", output_field=CharField()))
            .filter(waited=OuterRef("waiting_for"))
        )
        qs = self._runs().filter(status=RunStatus.SUSPENDED, waiting_for__startswith="child:")
        return [orm.to_record(run) for run in qs.filter(Exists(ended_child)).select_related("parent")[:1000]]

    def runs_on_queues(self, statuses: Sequence[str]) -> list[RunRecord]:
        qs = self._runs().filter(status__in=list(statuses)).exclude(queue="").select_related("parent")
        return [orm.to_record(run) for run in qs[:1000]]

    # -- strategies ------------------------------------------------------------
    @orm.kept_connection
    def run_keys(self, run_id: str) -> list[str]:
        tags = self._tags().filter(run__run_id=run_id, tag__startswith=TAG_PREFIX).values_list("tag", flat=True)
        return sorted(t[len(TAG_PREFIX) :] for t in tags)

    @orm.kept_connection
    def quota_settings(self, keys: Sequence[str]) -> dict[str, tuple[int | None, tuple[str, ...]]]:
        rows = orm.models().ConcurrencyLock.objects.using(self.using).filter(key__in=list(keys))
        return {row.key: (row.limit, tuple(row.count_statuses)) for row in rows}

    @orm.kept_connection
    def queued_heads(self, tag: str, *, namespace: str | None = None) -> list[tuple[str, str]]:
        queued = self._tags().counting(tag, [RunStatus.QUEUED])
        if namespace is not None:
            queued = queued.filter(namespace=namespace)
        # The first queued tag row of each group, and its run, in one statement.
        firsts = queued.values("group_key").annotate(first=Min("id")).values("first")
        heads = self._tags().filter(id__in=firsts).values_list("group_key", "run__run_id")
        return sorted(heads)

    @orm.kept_connection
    def rr_cursor(self, key: str) -> str:
        Lock = orm.models().ConcurrencyLock
        return Lock.objects.using(self.using).filter(key=key).values_list("rr_cursor", flat=True).first() or ""

    @orm.kept_connection
    def set_rr_cursor(self, key: str, group: str) -> None:
        orm.models().ConcurrencyLock.objects.using(self.using).filter(key=key).update(rr_cursor=group)

    def promote(
        self, keys: Sequence[str] = (), *, run_id: str | None = None, count_namespace: str | None = None
    ) -> list[RunRecord] | None:
        """On PostgreSQL the hand-offs of ``admission.Promoter.promote`` in one call
        of ``durable_promote`` (a second only when a lock out of key order was busy):
        the runs it made pending, for the caller to send. None elsewhere.

        Outside a transaction the call commits asynchronously: a hand-off lost in a
        crash of the database leaves its run queued, for the sweeper to hand on."""
        connection = self._lifecycle()
        if connection is None:
            return None
        started: list[RunRecord] = []
        lock_first: list[str] | None = None
        for _ in range(_PROMOTE_CALLS):
            with connection.cursor() as cursor:
                cursor.execute(
                    admitting.PROMOTE_SQL,
                    [
                        json.dumps(list(keys)),
                        run_id,
                        count_namespace,
                        orm.jsonb(lock_first),
                        timezone.now(),
                        not connection.in_atomic_block,  # its own transaction: commit without waiting for the disk
                    ],
                )
                handed, lock_first = admitting.promote_answer(cursor.fetchone()[0])
            started.extend(handed)
            if lock_first is None:
                break
        return started

    def keys_with_queued(self) -> dict[str, list[str]]:
        rows = self._tags().filter(status=RunStatus.QUEUED, tag__startswith=TAG_PREFIX).values_list("namespace", "tag").distinct()
        found: dict[str, list[str]] = {}
        for namespace, tag in sorted(rows):
            found.setdefault(namespace, []).append(tag[len(TAG_PREFIX) :])
        return found

    # -- step-level quotas (durable.stores.slots) ----------------------------------
    @orm.kept_connection
    def acquire_slot(self, run_id: str, lease: str, position: int, *, key: str, limit: int, queue: bool) -> SlotAnswer:
        return slots.acquire(self, run_id, lease, position, key=key, limit=limit, queue=queue)

    @orm.kept_connection
    def release_slot(self, run_id: str, position: int, *, key: str, lease: str) -> list[str]:
        return slots.release(self, run_id, position, key=key, lease=lease)

    @orm.kept_connection
    def release_slot_waking(self, run_id: str, position: int, *, key: str, lease: str) -> tuple[list[RunRecord], list[str]]:
        return slots.release_waking(self, run_id, position, key=key, lease=lease)

    @orm.kept_connection
    def release_run_slots(self, run_id: str) -> list[tuple[str, str]]:
        return slots.release_run(self, run_id)

    @orm.kept_connection
    def hand_off_key_slots(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        return slots.hand_off_keys(self, keys)

    def hand_off_slots(self) -> list[tuple[str, str]]:
        return slots.hand_off_all(self)

    # -- recovery ------------------------------------------------------------
    def orphaned_runs(self, heartbeat_before: datetime, dispatched_before: Sequence[datetime] = ()) -> list[RunRecord]:
        qs = self._runs().orphaned(heartbeat_before).redispatch_due(dispatched_before, first_at_once=True)
        return [orm.to_record(run) for run in qs.select_related("parent")[:1000]]

    def undelivered_runs(self, dispatched_before: Sequence[datetime]) -> list[RunRecord]:
        return [orm.to_record(run) for run in self._runs().undelivered(dispatched_before).select_related("parent")[:1000]]

    def mark_dispatched(self, run_ids: Sequence[str]) -> None:
        self._runs().filter(run_id__in=list(run_ids)).update(dispatched_at=timezone.now(), redispatches=F("redispatches") + 1)

    def purge_finished(self, before: Mapping[str, datetime], *, limit: int) -> list[str]:
        """Batches of ``durable.retention`` (raw ``DELETE ... IN`` per table, runs locked and read again)."""
        from durable import retention

        return retention.purge_some(before, limit=limit, using=self.using)


#: How many calls of ``durable_promote`` one promote makes at most (each further one
#: takes first the locks the call before found busy out of key order).
_PROMOTE_CALLS = 100
