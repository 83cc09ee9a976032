"""A run's life on Django's ORM: ``DjangoStore``'s claim, heartbeat, journal
writes, suspension, signals, finish and retry (on PostgreSQL one call of
``durable_take``, ``durable_record_step`` or ``durable_end`` each, see
``durable/sql/lifecycle.sql``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from durable.concurrency import TAG_PREFIX
from durable.status import TERMINAL_STATUSES, RunStatus
from durable.stores import orm
from durable.stores.base import DURATION_EVERY, Finished, RunRecord, StepEntry, add_duration


class Lifecycle(orm.ORMStore):
    """``DjangoStore``'s state changes of a run, from its claim to its end."""

    # -- state changes -------------------------------------------------------
    def _set_status(self, qs: Any, status: str, **fields: Any) -> bool:
        """Compare-and-set: update the runs of ``qs`` and mirror the status on their tags."""
        models = orm.models()
        # Inside a caller's transaction (a hand-off, a resume), no savepoint: an
        # error here leaves that transaction anyway, and a savepoint costs two
        # round trips on the hand-off path.
        with transaction.atomic(using=self.using, savepoint=False):
            pks = list(qs.select_for_update().values_list("pk", flat=True))
            if not pks:
                return False
            self._runs().filter(pk__in=pks).update(status=status, updated_at=timezone.now(), **fields)
            models.RunTag.objects.using(self.using).filter(run_id__in=pks).update(status=status)
        return True

    @orm.kept_connection
    def transition(
        self,
        run_id: str,
        *,
        from_statuses: Sequence[str],
        to: str,
        expect: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> bool:
        qs = self._runs().filter(run_id=run_id, status__in=list(from_statuses), **(expect or {}))
        if to == RunStatus.PENDING:  # a pending run's message is sent now: the sweeper waits from here
            fields = {"dispatched_at": timezone.now(), "redispatches": 0, **fields}
        return self._set_status(qs, to, **fields)

    def claim(self, run_id: str, *, lease: str, worker: str, stale_before: datetime) -> RunRecord | None:
        now = timezone.now()
        qs = (
            self._runs()
            .filter(run_id=run_id)
            .filter(
                # A worker that got the message of a blocked run proves its queue is served.
                Q(status__in=[RunStatus.PENDING, RunStatus.BLOCKED]) | Q(status=RunStatus.RUNNING, heartbeat_at__lt=stale_before)
            )
        )
        claimed = self._set_status(
            qs,
            RunStatus.RUNNING,
            lease=lease,
            worker=worker,
            attempt=F("attempt") + 1,
            heartbeat_at=now,
            started_at=Coalesce(F("started_at"), now),
            redispatches=0,
        )
        return self.get_run(run_id) if claimed else None

    def claim_journal(
        self, run_id: str, *, lease: str, worker: str, stale_before: datetime
    ) -> tuple[RunRecord, list[StepEntry] | None] | None:
        """On PostgreSQL one call of ``durable_take``: the claim, the status mirrored
        on the tags, the run and its journal read back. Elsewhere ``claim``, and the
        engine reads the journal.

        Outside a transaction the claim commits asynchronously where losing it in a
        crash of the database cannot change a quota's count (see ``durable_take``):
        the run is then only executed again from its journal."""
        connection = self._lifecycle()
        if connection is None:
            return super().claim_journal(run_id, lease=lease, worker=worker, stale_before=stale_before)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT durable_take(%s, %s, %s, %s, %s, %s)",
                [run_id, lease, worker, stale_before, timezone.now(), not connection.in_atomic_block],
            )
            claimed = orm.decoded(cursor.fetchone()[0])
        if claimed is None:
            return None
        record = orm.run_record(claimed["run"])
        steps = [
            StepEntry(
                s["position"], s["name"], s["outcome"], s["output"], s["error"], s["attempts"], orm.from_iso(s["started_at"])
            )
            for s in claimed["steps"]
        ]
        return record, steps

    @orm.reconnecting
    def holds(self, run_id: str, lease: str) -> bool:
        connection = self._lifecycle()
        if connection is None:
            return super().holds(run_id, lease)
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT EXISTS (SELECT 1 FROM {orm.models().WorkflowRun._meta.db_table} "
                "WHERE run_id = %s AND status = %s AND lease = %s)",
                [run_id, RunStatus.RUNNING, lease],
            )
            return bool(cursor.fetchone()[0])

    @orm.reconnecting
    def heartbeat(self, run_id: str, lease: str) -> bool:
        return bool(self._runs().filter(run_id=run_id, status=RunStatus.RUNNING, lease=lease).update(heartbeat_at=timezone.now()))

    @orm.reconnecting
    def finish(self, run_id: str, lease: str, *, status: str, output: Any = None, error: Any = None) -> bool | Finished:
        """On PostgreSQL one call of ``durable_end``, which also counts the run's quota
        keys that need a hand-off (none when each key's lock was free and no run of
        it is queued: then no ``durable_promote`` follows); whether the run has step
        slot rows is read in the same statement."""
        models = orm.models()
        connection = self._lifecycle()
        if connection is not None:
            slots = models.StepSlot._meta.db_table
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT durable_end(%s, %s, %s, %s::jsonb, %s::jsonb, %s), EXISTS (SELECT 1 FROM {slots} s "
                    f"WHERE s.run_id = (SELECT r.id FROM {models.WorkflowRun._meta.db_table} r WHERE r.run_id = %s))",
                    [run_id, lease, status, orm.jsonb(output), orm.jsonb(error), timezone.now(), run_id],
                )
                keys, held_slots = cursor.fetchone()
            return False if keys is None else Finished(hand_off=keys > 0, held_slots=held_slots)
        qs = self._runs().filter(run_id=run_id, status=RunStatus.RUNNING, lease=lease)
        has_slots = Exists(models.StepSlot.objects.using(self.using).filter(run_id=OuterRef("pk")))
        with transaction.atomic(using=self.using):
            now = timezone.now()
            # What _set_status does, with the run's step slot rows looked up in its first statement.
            found = qs.select_for_update().annotate(has_slots=has_slots).values_list("pk", "has_slots").first()
            if found is None:
                return False
            pk, held_slots = found
            ended = {"output": output, "error": error, "lease": "", "finished_at": now}
            self._runs().filter(pk=pk).update(status=status, updated_at=now, **ended)
            models.RunTag.objects.using(self.using).filter(run_id=pk).update(status=status)
            held_keys = self._record_durations(run_id, now)
        return Finished(hand_off=held_keys, held_slots=bool(held_slots))

    def _record_durations(self, run_id: str, now: datetime) -> bool:
        """The generic path of what ``durable_end`` does on PostgreSQL: add the
        time each of the run's keys' slots was held (from its tag's creation) to
        the key's ``recent_durations``; whether the run held any key. Elsewhere
        (SQLite) a write takes the whole database's lock: no row lock to skip."""
        models = orm.models()
        tags = self._tags().filter(run__run_id=run_id, tag__startswith=TAG_PREFIX).values_list("tag", "created_at")
        held = {tag[len(TAG_PREFIX) :]: (now - created).total_seconds() for tag, created in tags}
        locks = models.ConcurrencyLock.objects.using(self.using)
        due = Q(durations_at__isnull=True) | Q(durations_at__lte=now - timedelta(seconds=DURATION_EVERY))
        for key, durations in locks.filter(due, key__in=list(held)).values_list("key", "recent_durations"):
            locks.filter(key=key).update(recent_durations=add_duration(durations, held[key]), durations_at=now)
        return bool(held)

    def retry(self, run_id: str, *, from_statuses: Sequence[str], tags: Sequence[str]) -> bool:
        models = orm.models()
        with transaction.atomic(using=self.using):
            qs = self._runs().filter(run_id=run_id, status__in=list(from_statuses))
            previous = qs.select_for_update().values_list("status", flat=True).first()
            done = self._set_status(
                qs,
                RunStatus.PENDING,
                output=None,
                error=None,
                attempt=0,
                generation=F("generation") + 1,
                lease="",
                started_at=None,  # the retry's first claim sets it again (run_started)
                finished_at=None,
                dispatched_at=timezone.now(),
                redispatches=0,
            )
            if done:
                run = self._runs().get(run_id=run_id)
                steps = models.StepRecord.objects.using(self.using).filter(run=run)
                last = steps.order_by("-position").values_list("pk", "outcome").first()
                if previous == RunStatus.FAILED and last is not None and last[1] == models.StepRecord.Outcome.FAILED:
                    steps.filter(pk=last[0]).delete()  # the failure that ended the run: it runs again
                # Its slot rows count no more (it ended): delete them, without the keys'
                # locks (no count changes), so none counts again now that it is active.
                models.StepSlot.objects.using(self.using).filter(run=run).delete()
                models.RunTag.objects.using(self.using).filter(run=run).delete()
                self._create_tags(run, tags)
        return done

    # -- journal -------------------------------------------------------------
    @orm.reconnecting
    @orm.kept_connection
    def load_steps(self, run_id: str) -> list[StepEntry]:
        rows = (
            orm.models()
            .StepRecord.objects.using(self.using)
            .filter(run__run_id=run_id)
            .order_by("position")
            .values_list("position", "name", "outcome", "output", "error", "attempts", "started_at")
        )
        return [StepEntry(*row) for row in rows]

    def _owned_run(self, run_id: str, lease: str) -> int | None:
        """Lock the run's row if it is running under ``lease``; its primary key, or None."""
        return (
            self._runs()
            .select_for_update()
            .filter(run_id=run_id, status=RunStatus.RUNNING, lease=lease)
            .values_list("pk", flat=True)
            .first()
        )

    def _write_step(self, run: int, step: StepEntry) -> None:
        orm.models().StepRecord.objects.using(self.using).update_or_create(
            run_id=run,
            position=step.position,
            defaults={
                "name": step.name,
                "outcome": step.outcome,
                "output": step.output,
                "error": step.error,
                "attempts": step.attempts,
                "started_at": step.started_at,
                "finished_at": timezone.now(),
            },
        )
        self._runs().filter(pk=run).update(heartbeat_at=timezone.now())

    @orm.reconnecting
    def record_step(self, run_id: str, lease: str, step: StepEntry) -> bool:
        """On PostgreSQL one call of ``durable_record_step`` (the lease check, the
        journal write, the heartbeat)."""
        connection = self._lifecycle()
        if connection is not None:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT durable_record_step(%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s)",
                    [
                        run_id,
                        lease,
                        step.position,
                        step.name,
                        step.outcome,
                        orm.jsonb(step.output),
                        orm.jsonb(step.error),
                        step.attempts,
                        step.started_at,
                        timezone.now(),
                    ],
                )
                return bool(cursor.fetchone()[0])
        with transaction.atomic(using=self.using):
            run = self._owned_run(run_id, lease)
            if run is None:
                return False
            self._write_step(run, step)
        return True

    # -- waiting -----------------------------------------------------------------
    @orm.reconnecting
    @orm.kept_connection
    def suspend(self, run_id: str, lease: str, *, waiting_for: str, wake_at: datetime | None) -> bool:
        models = orm.models()
        with transaction.atomic(using=self.using):
            run = self._owned_run(run_id, lease)
            if run is None:
                return False
            kind, _, target = waiting_for.partition(":")
            if (
                kind == "signal"
                and models.Signal.objects.using(self.using)
                .filter(run_id=run, name=target, consumed_at_position__isnull=True)
                .exists()
            ):
                return False
            if kind == "child" and self._runs().filter(run_id=target, status__in=TERMINAL_STATUSES).exists():
                return False
            return self._set_status(
                self._runs().filter(pk=run),
                RunStatus.SUSPENDED,
                waiting_for=waiting_for,
                wake_at=wake_at,
                lease="",
                attempt=0,
            )

    @orm.kept_connection
    def add_signal(self, run_id: str, name: str, payload: Any) -> RunRecord | None:
        with transaction.atomic(using=self.using):
            run = self._runs().select_for_update().filter(run_id=run_id).first()
            if run is None:
                return None
            if run.status not in TERMINAL_STATUSES:
                orm.models().Signal.objects.using(self.using).create(run=run, name=name, payload=payload)
            return orm.to_record(run)

    @orm.kept_connection
    def consume_signal(self, run_id: str, lease: str, name: str, step: StepEntry) -> tuple[bool, Any]:
        Signal = orm.models().Signal
        with transaction.atomic(using=self.using):
            run = self._owned_run(run_id, lease)
            if run is None:
                return False, None
            signal = (
                Signal.objects.using(self.using)
                .select_for_update()
                .filter(run_id=run, name=name, consumed_at_position__isnull=True)
                .order_by("id")
                .first()
            )
            if signal is None:
                return False, None
            signal.consumed_at_position = step.position
            signal.save(update_fields=["consumed_at_position"])
            self._write_step(run, replace(step, output={"payload": signal.payload}))
            return True, signal.payload
