"""``DjangoStore``: the store on Django's ORM (PostgreSQL in production, SQLite embedded)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.db import IntegrityError, InterfaceError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import CharField, Exists, F, Min, OuterRef, Q, Value
from django.db.models.functions import Coalesce, Concat
from django.utils import timezone

from durable import conf, exceptions
from durable.concurrency import BORROWED_PREFIX, TAG_PREFIX, Quota, Strategy, replaced_error
from durable.status import TERMINAL_STATUSES, RunStatus
from durable.stores import slots
from durable.stores.base import (
    DURATION_EVERY,
    BaseStore,
    Finished,
    LimitChangeRecord,
    RunExists,
    RunRecord,
    SlotAnswer,
    StepEntry,
    add_duration,
    estimate,
    group_keys,
)

if TYPE_CHECKING:
    from durable.models import WorkflowRun

_RECORD_FIELDS = (
    "run_id",
    "workflow",
    "version",
    "namespace",
    "status",
    "input",
    "output",
    "error",
    "attempt",
    "generation",
    "lease",
    "worker",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
    "heartbeat_at",
    "dispatched_at",
    "redispatches",
    "queue",
    "waiting_for",
    "wake_at",
    "fenced",
)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _reconnecting(method: _Method) -> _Method:
    """Run an idempotent store call once more on a fresh connection when the first
    try lost its connection (a database restart, ``pg_terminate_backend``, a network
    blip). Not inside a caller's transaction: that one is lost anyway."""

    @functools.wraps(method)
    def call(self: DjangoStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (OperationalError, InterfaceError):
            if not self.recover():
                raise
            return method(self, *args, **kwargs)

    return cast(_Method, call)


def _models() -> Any:
    # Imported lazily: the store is built before the app registry is ready.
    from durable import models

    return models


class DjangoStore(BaseStore):
    """Runs, tags, locks and the journal in the project's database.

    ``using`` names the database alias (default ``"default"``).
    """

    def __init__(self, using: str = "default") -> None:
        self.using = using

    def _postgres(self) -> BaseDatabaseWrapper | None:
        """This store's connection when it is PostgreSQL, where durable's SQL
        functions are installed (one round trip per state change); else None, and
        the store takes its generic ORM path."""
        connection = connections[self.using]
        return connection if connection.vendor == "postgresql" else None

    # -- reads -------------------------------------------------------------
    def _runs(self) -> Any:
        return _models().WorkflowRun.objects.using(self.using)

    @_reconnecting
    def get_run(self, run_id: str) -> RunRecord | None:
        row = self._runs().filter(run_id=run_id).select_related("parent").first()
        return None if row is None else to_record(row)

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
        return [to_record(row) for row in qs]

    def count_runs(
        self,
        *,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> int:
        if tag is None:
            return int(self._runs().in_namespace(namespace).with_statuses(statuses).count())
        qs = _models().RunTag.objects.using(self.using).counting(tag, statuses)
        if namespace is not None:
            qs = qs.filter(namespace=namespace)
        return int(qs.count())

    # -- admission ---------------------------------------------------------
    @contextmanager
    def admission(self, quotas: Sequence[Quota]) -> Iterator[Sequence[Quota]]:
        try:
            with transaction.atomic(using=self.using):
                yield self._lock(quotas) if quotas else quotas
        except IntegrityError as exc:
            # The only unique value a start can collide on is the run id: two
            # starters raced with the same explicit id.
            raise RunExists(str(exc)) from exc
        except exceptions.ConcurrencyLimitError:
            # The refusal rolled back what _lock wrote: record the limits anyway.
            self._note_limits(quotas)
            raise

    def _lock(self, quotas: Sequence[Quota]) -> list[Quota]:
        """Lock each key's row, one key at a time in key order (so starts sharing
        several keys can never deadlock), creating a missing row first: a row that
        does not exist locks nothing, and INSERT ... ON CONFLICT DO NOTHING waits
        for a concurrent insert of the same key. Returns ``quotas`` with the limit
        in effect, an override read from the locked row replacing the code's."""
        Lock = _models().ConcurrencyLock
        locks = Lock.objects.using(self.using).select_for_update()
        overrides: dict[str, int] = {}
        for quota in sorted(quotas, key=lambda q: q.key):
            statuses = list(quota.count_statuses)
            burst = None if quota.burst is None else {"pool": quota.burst.pool, "up_to": quota.burst.up_to}
            row = locks.filter(key=quota.key).first()
            if row is None:
                Lock.objects.using(self.using).bulk_create(
                    [Lock(key=quota.key, limit=quota.limit, count_statuses=statuses, burst=burst)], ignore_conflicts=True
                )
                row = locks.get(key=quota.key)
            if row.limit != quota.limit or row.count_statuses != statuses or row.burst != burst:
                Lock.objects.using(self.using).filter(key=quota.key).update(
                    limit=quota.limit, count_statuses=statuses, burst=burst
                )
            if row.limit_override is not None:
                overrides[quota.key] = row.limit_override
        return [replace(q, limit=overrides[q.key]) if q.key in overrides else q for q in quotas]

    def limit_overrides(self, keys: Sequence[str]) -> dict[str, int]:
        rows = _models().ConcurrencyLock.objects.using(self.using).filter(key__in=list(keys), limit_override__isnull=False)
        return dict(rows.values_list("key", "limit_override"))

    def set_limit_override(
        self, key: str, limit: int | None, *, reason: str, changed_by: Any = None, changed_by_name: str = ""
    ) -> LimitChangeRecord:
        """Lock the key's row (creating it, with no known limit, for a key no start
        has used yet), write the override and its ``LimitChange``, in one transaction."""
        models = _models()
        locks = models.ConcurrencyLock.objects.using(self.using)
        with transaction.atomic(using=self.using):
            row = locks.select_for_update().filter(key=key).first()
            if row is None:
                locks.bulk_create([models.ConcurrencyLock(key=key, count_statuses=[])], ignore_conflicts=True)
                row = locks.select_for_update().get(key=key)
            old_override, old_limit = row.limit_override, row.effective_limit
            row.limit_override = limit
            locks.filter(key=key).update(limit_override=limit)
            change = models.LimitChange.objects.using(self.using).create(
                key=key,
                old_override=old_override,
                new_override=limit,
                old_limit=old_limit,
                new_limit=row.effective_limit,
                reason=reason,
                changed_by=changed_by,
                changed_by_name=changed_by_name,
            )
            change.refresh_from_db(fields=["changed_at"])
        return LimitChangeRecord(**{field.name: getattr(change, field.name) for field in dataclasses.fields(LimitChangeRecord)})

    def retry_estimate(self, quota: Quota, *, namespace: str | None = None) -> float | None:
        """The generic path's estimate (PostgreSQL's admission functions make their own):
        the key's ``recent_durations`` and the creation of its oldest tag in flight."""
        models = _models()
        durations = (
            models.ConcurrencyLock.objects.using(self.using)
            .filter(key=quota.key)
            .values_list("recent_durations", flat=True)
            .first()
        )
        if not durations:
            return None
        tags = models.RunTag.objects.using(self.using).counting(quota.tag, quota.count_statuses)
        if namespace is not None:
            tags = tags.filter(namespace=namespace)
        oldest = tags.aggregate(oldest=Min("created_at"))["oldest"]
        age = None if oldest is None else (timezone.now() - oldest).total_seconds()
        return estimate(durations, age)

    def _note_limits(self, quotas: Sequence[Quota]) -> None:
        """Record a refused start's limits and ``count_statuses`` on its keys' rows.

        A refused start writes nothing else, yet its limit is the one admission
        applies now (a plan changed from 5 to 2): the admin, the quota API and
        hand-offs read it from these rows. Never waits: a row locked by another
        starter is skipped (that starter records its own, equally current, limit),
        and an unchanged row is not written.
        """
        if not quotas:
            return
        Lock = _models().ConcurrencyLock
        connection = self._postgres()
        if connection is not None:
            payload = json.dumps([{"key": q.key, "limit": q.limit, "statuses": list(q.count_statuses)} for q in quotas])
            table = connection.ops.quote_name(Lock._meta.db_table)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"""UPDATE {table} AS l SET "limit" = (q->>'limit')::integer, count_statuses = q->'statuses'
                          FROM jsonb_array_elements(%s::jsonb) AS q
                         WHERE l.key = q->>'key' AND l.key IN (
                               SELECT k.key FROM {table} AS k JOIN jsonb_array_elements(%s::jsonb) AS p
                                   ON k.key = p->>'key'
                                WHERE k."limit" IS DISTINCT FROM (p->>'limit')::integer
                                   OR k.count_statuses <> p->'statuses'
                                  FOR UPDATE OF k SKIP LOCKED)""",
                    [payload, payload],
                )
            return
        # Elsewhere (SQLite) a write takes the whole database's lock: no row locks to skip.
        for quota in quotas:
            statuses = list(quota.count_statuses)
            stale = Lock.objects.using(self.using).filter(~Q(limit=quota.limit) | ~Q(count_statuses=statuses))
            stale.filter(key=quota.key).update(limit=quota.limit, count_statuses=statuses)

    def admit(
        self, record: RunRecord, quotas: Sequence[Quota], *, count_namespace: str | None, run_id_given: bool = False
    ) -> bool:
        """The whole REJECT admission in one round trip, on PostgreSQL (the function
        ``durable_admit``): False when this database has no such path (use the
        generic one). Raises ``ConcurrencyLimitError`` or ``RunExists``.

        ``run_id_given``: the caller chose the run id; a refusal then first makes
        sure no run has it (waiting for a start of it not yet committed), and
        raises ``RunExists`` if one has."""
        connection = self._postgres()
        if connection is None:
            return False
        ordered = sorted(quotas, key=lambda q: q.key)
        groups = group_keys([q.tag for q in ordered])
        payload = [{"key": q.key, "limit": q.limit, "statuses": list(q.count_statuses), "group": groups[q.tag]} for q in ordered]
        bursting = [(entry, q.burst) for entry, q in zip(payload, ordered, strict=True) if q.burst is not None]
        for entry, burst in bursting:
            entry.update(burst={"pool": burst.pool, "up_to": burst.up_to}, pool_limit=burst.pool_limit)
        if bursting and connection.in_atomic_block:
            row = self._admit_in_transaction(connection, payload, record, count_namespace, run_id_given, ordered)
        else:
            row = self._admit_in_key_order(connection, payload, record, count_namespace, run_id_given, ordered)
        outcome, key, limit, active, _, durations, oldest_age, burst_detail = row[:8]
        seconds = conf.retry_after_seconds(estimate(_json(durations), oldest_age))
        burst_detail = _json(burst_detail)
        if outcome == "full":  # the function recorded the refused limits already
            raise exceptions.ConcurrencyLimitError(
                workflow=record.workflow, key=key, limit=limit, active=active, retry_after=seconds, **(burst_detail or {})
            )
        if outcome == "exists":
            raise RunExists(record.run_id)
        if burst_detail:
            # The function answers which keys borrowed: a key on a used pool may be within its limit.
            borrowed = [TAG_PREFIX + pool for pool in burst_detail["borrowed"]]
            borrowed += [BORROWED_PREFIX + key for key in burst_detail["keys"]]
            record.tags = list(dict.fromkeys([q.tag for q in ordered] + borrowed))
        return True

    def _admit_in_key_order(
        self,
        connection: BaseDatabaseWrapper,
        payload: list[dict[str, Any]],
        record: RunRecord,
        count_namespace: str | None,
        run_id_given: bool,
        ordered: Sequence[Quota],
    ) -> tuple[Any, ...]:
        """``durable_admit`` of a start outside the caller's transaction (it holds no other
        lock), or without a burst.

        A pool sorting before one of the keys is taken with NOWAIT: if it is busy the
        call raises lock_not_available, and is made again with every pool locked with
        the keys, in key order (it then waits for locks in key order only)."""
        bursts = [q.burst for q in ordered if q.burst is not None]
        out_of_order = any(burst.pool < ordered[-1].key for burst in bursts)
        for lock_pools in (False, True) if out_of_order else (True,):
            _set_burst_flags(payload, lock_pool=lock_pools)
            try:
                return self._call_admit(connection, payload, record, count_namespace, run_id_given, retry=not lock_pools)
            except OperationalError as exc:
                if lock_pools or getattr(exc.__cause__, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                    raise
        raise AssertionError("unreachable: the last call returns or raises")

    def _admit_in_transaction(
        self,
        connection: BaseDatabaseWrapper,
        payload: list[dict[str, Any]],
        record: RunRecord,
        count_namespace: str | None,
        run_id_given: bool,
        ordered: Sequence[Quota],
    ) -> tuple[Any, ...]:
        """``durable_admit`` of a start with a burst inside the caller's transaction.

        That transaction may hold keys of earlier starts that sort after the pool, and
        a savepoint's rollback does not release them: waiting for the pool could close
        a cycle of waits. So, once it holds any lock (durable_admit tells: it has a
        transaction id), the pool is never waited for (NOWAIT wherever it sorts), only
        locked when the run borrows (a guaranteed start never reads it), and a busy
        pool is tried again a few times, each call in a savepoint (which releases what
        the call locked), after a short back-off; then ``PoolBusyError``. A transaction
        that held nothing before the first call is retried as outside one: it holds
        nothing once the savepoint is rolled back (docs/explanation/burst.md, "Inside
        your own transaction")."""
        _set_burst_flags(payload, lock_pool=False, in_transaction=True)
        for attempt, pause in enumerate((*_POOL_BACKOFF, None), start=1):
            try:
                return self._call_admit(connection, payload, record, count_namespace, run_id_given, retry=True)
            except OperationalError as exc:
                if getattr(exc.__cause__, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                    raise
                detail = getattr(getattr(exc.__cause__, "diag", None), "message_detail", None)
                if attempt == 1 and detail == _NOTHING_HELD:
                    _set_burst_flags(payload, lock_pool=True, in_transaction=False)
                    return self._call_admit(connection, payload, record, count_namespace, run_id_given, retry=False)
                if pause is None:
                    pools = sorted({q.burst.pool for q in ordered if q.burst is not None})
                    raise exceptions.PoolBusyError(workflow=record.workflow, pools=pools, attempts=attempt) from exc
                time.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _call_admit(
        self,
        connection: BaseDatabaseWrapper,
        payload: list[dict[str, Any]],
        record: RunRecord,
        count_namespace: str | None,
        run_id_given: bool,
        *,
        retry: bool,
    ) -> tuple[Any, ...]:
        """One call of ``durable_admit``; with ``retry`` (it may raise lock_not_available to
        be made again) inside a savepoint when a transaction is open, so that the error
        leaves that transaction usable and the locks the call took are released."""
        savepoint = transaction.atomic(using=self.using) if retry and connection.in_atomic_block else contextlib.nullcontext()
        with savepoint, connection.cursor() as cursor:
            cursor.execute(
                "SELECT * FROM durable_admit(%s::jsonb, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s)",
                [json.dumps(payload), *_start_params(record, count_namespace, run_id_given)],
            )
            return tuple(cursor.fetchone())

    def admit_queued(
        self,
        record: RunRecord,
        quotas: Sequence[Quota],
        *,
        count_namespace: str | None,
        run_id_given: bool = False,
        ancestors: Sequence[RunRecord] = (),
        superseded: list[RunRecord] | None = None,
    ) -> bool:
        """The admission of a start whose quotas are REJECT and/or the queueing
        strategies in one round trip, on PostgreSQL (the function
        ``durable_admit_queued``): it decides as ``admission.decide`` does, creates
        the run ``pending``, ``queued`` or ``cancelled`` (``record`` is updated) and
        cancels the queued runs it replaces (appended to ``superseded``). False when
        this database has no such path. Raises ``ConcurrencyLimitError``
        (``ConcurrencyQueueFullError``) or ``RunExists``."""
        connection = self._postgres()
        if connection is None:
            return False
        groups = group_keys([q.tag for q in quotas])
        payload = [
            {
                "key": q.key,
                "limit": q.limit,
                "statuses": list(q.count_statuses),
                "group": groups[q.tag],
                "strategy": str(q.strategy),
                "max_queued": q.max_queued,
                "replaced_error": replaced_error(q.key, record.run_id)
                if q.strategy is Strategy.CANCEL_QUEUED_EXCEPT_NEWEST
                else None,
            }
            for q in quotas
        ]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT * FROM durable_admit_queued(%s::jsonb, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s::jsonb)",
                [
                    json.dumps(payload),
                    *_start_params(record, count_namespace, run_id_given),
                    json.dumps([{"run_id": a.run_id, "status": str(a.status)} for a in ancestors]),
                ],
            )
            row = cursor.fetchone()
        outcome, status, key, limit, active, queued, max_queued, reason, holder, durations, oldest_age = row[:11]
        run_error, finished_at, cancelled = row[11:]
        seconds = conf.retry_after_seconds(estimate(_json(durations), oldest_age))
        if outcome == "created":
            record.status = status
            if status == RunStatus.CANCELLED:
                record.error, record.finished_at = _json(run_error), finished_at
            if superseded is not None:
                superseded.extend(_run_record(run) for run in _json(cancelled) or [])
            return True
        if outcome == "exists":
            raise RunExists(record.run_id)
        if outcome == "queue_full":
            raise exceptions.ConcurrencyQueueFullError(
                workflow=record.workflow,
                key=key,
                limit=limit,
                active=active,
                queued=queued,
                max_queued=max_queued,
                retry_after=seconds,
            )
        hint = ""
        if reason == "lifetime":
            hint = exceptions.LIFETIME_CAP_HINT
        elif reason == "ancestor":
            hint = exceptions.holding_ancestor_hint(holder)
        raise exceptions.ConcurrencyLimitError(
            workflow=record.workflow,
            key=key,
            limit=limit,
            active=active,
            hint=hint,
            retry_after=seconds,
        )

    def run_exists(self, run_id: str) -> bool:
        """Whether a run has this id, once any start of it not yet committed has ended.

        On PostgreSQL a run inserted by a transaction still open is invisible, so
        this inserts the id (ON CONFLICT DO NOTHING waits for that transaction)
        and deletes its own row at once; inside an admission, that row is never
        seen by anyone. SQLite's write lock already serialised the starts.
        """
        connection = self._postgres()
        if connection is None:
            return bool(self._runs().filter(run_id=run_id).exists())
        table = connection.ops.quote_name(_models().WorkflowRun._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (run_id, workflow, version, namespace, status, attempt, generation,"
                " lease, worker, queue, waiting_for) VALUES (%s, '', '', '', 'pending', 0, 0, '', '', '', '')"
                " ON CONFLICT (run_id) DO NOTHING RETURNING id",
                [run_id],
            )
            row = cursor.fetchone()
            if row is None:
                return True
            cursor.execute(f"DELETE FROM {table} WHERE id = %s", [row[0]])
        return False

    def create_run(self, record: RunRecord, tags: Sequence[str]) -> None:
        parent_id = None
        if record.parent_run_id:
            parent_id = self._runs().filter(run_id=record.parent_run_id).values_list("pk", flat=True).first()
        run = self._runs().create(
            run_id=record.run_id,
            workflow=record.workflow,
            version=record.version,
            namespace=record.namespace,
            status=record.status,
            input=record.input,
            error=record.error,
            queue=record.queue,
            parent_id=parent_id,
            dispatched_at=timezone.now(),
            finished_at=record.finished_at,
            fenced=record.fenced,
        )
        self._create_tags(run, tags)

    def _create_tags(self, run: WorkflowRun, tags: Sequence[str]) -> None:
        if not tags:
            return
        RunTag = _models().RunTag
        groups = group_keys(tags)
        RunTag.objects.using(self.using).bulk_create(
            [RunTag(run=run, tag=t, status=run.status, namespace=run.namespace, group_key=groups[t]) for t in tags]
        )

    def on_commit(self, fn: Callable[[], object]) -> None:
        transaction.on_commit(fn, using=self.using)

    # -- state changes -------------------------------------------------------
    def _set_status(self, qs: Any, status: str, **fields: Any) -> bool:
        """Compare-and-set: update the runs of ``qs`` and mirror the status on their tags."""
        models = _models()
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
        connection = self._postgres()
        if connection is None:
            return super().claim_journal(run_id, lease=lease, worker=worker, stale_before=stale_before)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT durable_take(%s, %s, %s, %s, %s, %s)",
                [run_id, lease, worker, stale_before, timezone.now(), not connection.in_atomic_block],
            )
            claimed = _json(cursor.fetchone()[0])
        if claimed is None:
            return None
        row = claimed["run"]
        for name in _DATETIME_FIELDS:
            row[name] = _datetime(row[name])
        record = RunRecord(**{name: row[name] for name in _RECORD_FIELDS}, parent_run_id=row["parent_run_id"])
        steps = [
            StepEntry(s["position"], s["name"], s["outcome"], s["output"], s["error"], s["attempts"], _datetime(s["started_at"]))
            for s in claimed["steps"]
        ]
        return record, steps

    @_reconnecting
    def heartbeat(self, run_id: str, lease: str) -> bool:
        return bool(self._runs().filter(run_id=run_id, status=RunStatus.RUNNING, lease=lease).update(heartbeat_at=timezone.now()))

    @_reconnecting
    def finish(self, run_id: str, lease: str, *, status: str, output: Any = None, error: Any = None) -> bool | Finished:
        """On PostgreSQL one call of ``durable_end``, which also counts the run's quota
        keys that need a hand-off (none when each key's lock was free and no run of
        it is queued: then no ``durable_promote`` follows); whether the run has step
        slot rows is read in the same statement."""
        models = _models()
        connection = self._postgres()
        if connection is not None:
            slots = models.StepSlot._meta.db_table
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT durable_end(%s, %s, %s, %s::jsonb, %s::jsonb, %s), EXISTS (SELECT 1 FROM {slots} s "
                    f"WHERE s.run_id = (SELECT r.id FROM {models.WorkflowRun._meta.db_table} r WHERE r.run_id = %s))",
                    [run_id, lease, status, _jsonb(output), _jsonb(error), timezone.now(), run_id],
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
        models = _models()
        tags = self._tags().filter(run__run_id=run_id, tag__startswith=TAG_PREFIX).values_list("tag", "created_at")
        held = {tag[len(TAG_PREFIX) :]: (now - created).total_seconds() for tag, created in tags}
        locks = models.ConcurrencyLock.objects.using(self.using)
        due = Q(durations_at__isnull=True) | Q(durations_at__lte=now - timedelta(seconds=DURATION_EVERY))
        for key, durations in locks.filter(due, key__in=list(held)).values_list("key", "recent_durations"):
            locks.filter(key=key).update(recent_durations=add_duration(durations, held[key]), durations_at=now)
        return bool(held)

    def retry(self, run_id: str, *, from_statuses: Sequence[str], tags: Sequence[str]) -> bool:
        models = _models()
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
    @_reconnecting
    def load_steps(self, run_id: str) -> list[StepEntry]:
        rows = (
            _models()
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
        _models().StepRecord.objects.using(self.using).update_or_create(
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

    @_reconnecting
    def record_step(self, run_id: str, lease: str, step: StepEntry) -> bool:
        """On PostgreSQL one call of ``durable_record_step`` (the lease check, the
        journal write, the heartbeat)."""
        connection = self._postgres()
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
                        _jsonb(step.output),
                        _jsonb(step.error),
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
    @_reconnecting
    def suspend(self, run_id: str, lease: str, *, waiting_for: str, wake_at: datetime | None) -> bool:
        models = _models()
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

    def add_signal(self, run_id: str, name: str, payload: Any) -> RunRecord | None:
        with transaction.atomic(using=self.using):
            run = self._runs().select_for_update().filter(run_id=run_id).first()
            if run is None:
                return None
            if run.status not in TERMINAL_STATUSES:
                _models().Signal.objects.using(self.using).create(run=run, name=name, payload=payload)
            return to_record(run)

    def consume_signal(self, run_id: str, lease: str, name: str, step: StepEntry) -> tuple[bool, Any]:
        Signal = _models().Signal
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

    def active_children(self, run_id: str) -> list[RunRecord]:
        qs = self._runs().active().filter(parent__run_id=run_id).select_related("parent")
        return [to_record(run) for run in qs]

    def due_runs(self, now: datetime) -> list[RunRecord]:
        qs = self._runs().filter(status=RunStatus.SUSPENDED, wake_at__lte=now).select_related("parent")
        return [to_record(run) for run in qs[:1000]]

    def waiting_parents(self) -> list[RunRecord]:
        ended_child = (
            self._runs()
            .filter(parent=OuterRef("pk"), status__in=TERMINAL_STATUSES)
            .annotate(waited=Concat(Value("child:"), "run_id", output_field=CharField()))
            .filter(waited=OuterRef("waiting_for"))
        )
        qs = self._runs().filter(status=RunStatus.SUSPENDED, waiting_for__startswith="child:")
        return [to_record(run) for run in qs.filter(Exists(ended_child)).select_related("parent")[:1000]]

    def runs_on_queues(self, statuses: Sequence[str]) -> list[RunRecord]:
        qs = self._runs().filter(status__in=list(statuses)).exclude(queue="").select_related("parent")
        return [to_record(run) for run in qs[:1000]]

    # -- strategies ------------------------------------------------------------
    def _tags(self) -> Any:
        return _models().RunTag.objects.using(self.using)

    def run_keys(self, run_id: str) -> list[str]:
        tags = self._tags().filter(run__run_id=run_id, tag__startswith=TAG_PREFIX).values_list("tag", flat=True)
        return sorted(t[len(TAG_PREFIX) :] for t in tags)

    def quota_settings(self, keys: Sequence[str]) -> dict[str, tuple[int | None, tuple[str, ...]]]:
        rows = _models().ConcurrencyLock.objects.using(self.using).filter(key__in=list(keys))
        return {row.key: (row.limit, tuple(row.count_statuses)) for row in rows}

    def queued_heads(self, tag: str, *, namespace: str | None = None) -> list[tuple[str, str]]:
        queued = self._tags().counting(tag, [RunStatus.QUEUED])
        if namespace is not None:
            queued = queued.filter(namespace=namespace)
        # The first queued tag row of each group, and its run, in one statement.
        firsts = queued.values("group_key").annotate(first=Min("id")).values("first")
        heads = self._tags().filter(id__in=firsts).values_list("group_key", "run__run_id")
        return sorted(heads)

    def rr_cursor(self, key: str) -> str:
        Lock = _models().ConcurrencyLock
        return Lock.objects.using(self.using).filter(key=key).values_list("rr_cursor", flat=True).first() or ""

    def set_rr_cursor(self, key: str, group: str) -> None:
        _models().ConcurrencyLock.objects.using(self.using).filter(key=key).update(rr_cursor=group)

    def promote(
        self, keys: Sequence[str] = (), *, run_id: str | None = None, count_namespace: str | None = None
    ) -> list[RunRecord] | None:
        """On PostgreSQL the hand-offs of ``admission.Promoter.promote`` in one call
        of ``durable_promote`` (a second only when a lock out of key order was busy):
        the runs it made pending, for the caller to send. None elsewhere.

        Outside a transaction the call commits asynchronously: a hand-off lost in a
        crash of the database leaves its run queued, for the sweeper to hand on."""
        connection = self._postgres()
        if connection is None:
            return None
        started: list[RunRecord] = []
        lock_first: list[str] | None = None
        for _ in range(_PROMOTE_CALLS):
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT durable_promote(%s::jsonb, %s, %s, %s::jsonb, %s, %s)",
                    [
                        json.dumps(list(keys)),
                        run_id,
                        count_namespace,
                        _jsonb(lock_first),
                        timezone.now(),
                        not connection.in_atomic_block,  # its own transaction: commit without waiting for the disk
                    ],
                )
                answer = _json(cursor.fetchone()[0])
            started.extend(_run_record(row) for row in answer["started"])
            lock_first = answer["retry"]
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
    def acquire_slot(self, run_id: str, lease: str, position: int, *, key: str, limit: int, queue: bool) -> SlotAnswer:
        return slots.acquire(self, run_id, lease, position, key=key, limit=limit, queue=queue)

    def release_slot(self, run_id: str, position: int, *, key: str, lease: str) -> list[str]:
        return slots.release(self, run_id, position, key=key, lease=lease)

    def release_run_slots(self, run_id: str) -> list[tuple[str, str]]:
        return slots.release_run(self, run_id)

    def hand_off_key_slots(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        return slots.hand_off_keys(self, keys)

    def hand_off_slots(self) -> list[tuple[str, str]]:
        return slots.hand_off_all(self)

    # -- recovery ------------------------------------------------------------
    def orphaned_runs(self, heartbeat_before: datetime, dispatched_before: Sequence[datetime] = ()) -> list[RunRecord]:
        qs = self._runs().orphaned(heartbeat_before).redispatch_due(dispatched_before, first_at_once=True)
        return [to_record(run) for run in qs.select_related("parent")[:1000]]

    def undelivered_runs(self, dispatched_before: Sequence[datetime]) -> list[RunRecord]:
        return [to_record(run) for run in self._runs().undelivered(dispatched_before).select_related("parent")[:1000]]

    def mark_dispatched(self, run_ids: Sequence[str]) -> None:
        self._runs().filter(run_id__in=list(run_ids)).update(dispatched_at=timezone.now(), redispatches=F("redispatches") + 1)

    def purge_finished(self, before: Mapping[str, datetime], *, limit: int) -> list[str]:
        """Batches of ``durable.retention`` (raw ``DELETE ... IN`` per table, runs locked and read again)."""
        from durable import retention

        return retention.purge_some(before, limit=limit, using=self.using)

    def release_thread(self) -> None:
        """Close this thread's connection (called by helper threads when they end)."""
        with contextlib.suppress(OperationalError, InterfaceError):  # a broken connection is gone already
            connections[self.using].close()

    def recover(self) -> bool:
        """Close this thread's connection if an error left it unusable, so that the
        next query opens a fresh one. False inside a transaction (its owner must
        roll back first)."""
        connection = connections[self.using]
        if connection.in_atomic_block:
            return False
        connection.close_if_unusable_or_obsolete()
        return True


_DATETIME_FIELDS = ("created_at", "updated_at", "started_at", "finished_at", "heartbeat_at", "dispatched_at", "wake_at")


#: PostgreSQL's SQLSTATE of a NOWAIT lock that is busy (durable_admit's pool lock out of key order).
_LOCK_NOT_AVAILABLE = "55P03"
#: The pauses between the calls of ``durable_admit`` that find a burst pool busy inside
#: the caller's transaction (4 calls in about 0.2 s), before ``PoolBusyError``.
_POOL_BACKOFF = (0.02, 0.05, 0.1)
#: durable_admit's DETAIL of a busy pool inside a transaction that held no lock before the call.
_NOTHING_HELD = "durable: nothing held"

#: How many calls of ``durable_promote`` one promote makes at most (each further one
#: takes first the locks the call before found busy out of key order).
_PROMOTE_CALLS = 100


def _run_record(row: dict[str, Any]) -> RunRecord:
    """A run read back as ``jsonb`` (a row of ``durable_workflowrun`` with ``parent_run_id``)."""
    for name in _DATETIME_FIELDS:
        row[name] = _datetime(row[name])
    return RunRecord(**{name: row[name] for name in _RECORD_FIELDS}, parent_run_id=row["parent_run_id"])


def _start_params(record: RunRecord, count_namespace: str | None, run_id_given: bool) -> list[Any]:
    """The parameters ``durable_admit`` and ``durable_admit_queued`` share, after the quotas:
    the namespace counted in, the run's columns, and whether the caller chose its id."""
    return [
        count_namespace,
        record.run_id,
        record.workflow,
        record.version,
        record.namespace,
        json.dumps(record.input),
        record.parent_run_id,
        record.queue,
        run_id_given,
    ]


def _set_burst_flags(payload: list[dict[str, Any]], **flags: bool) -> None:
    """Set how ``durable_admit`` takes the pools (``lock_pool``, ``in_transaction``) on
    the payload's entries with a burst."""
    for entry in payload:
        if "burst" in entry:
            entry.update(flags)


def _jsonb(value: Any) -> str | None:
    """A JSON value as a ``jsonb`` parameter; None is SQL NULL, as the ORM stores it."""
    return None if value is None else json.dumps(value)


def _json(value: Any) -> Any:
    """A ``jsonb`` result: the driver may hand it over decoded or as text."""
    return json.loads(value) if isinstance(value, str) else value


def _datetime(value: str | None) -> datetime | None:
    """A ``timestamptz`` read back from ``jsonb`` (ISO 8601), in UTC as the ORM reads it."""
    return None if value is None else datetime.fromisoformat(value).astimezone(UTC)


def to_record(run: WorkflowRun) -> RunRecord:
    record = RunRecord(**{name: getattr(run, name) for name in _RECORD_FIELDS})
    if run.parent is not None:
        record.parent_run_id = run.parent.run_id
    return record
