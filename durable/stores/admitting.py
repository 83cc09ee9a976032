"""Admission on Django's ORM: ``DjangoStore``'s ``admission`` (the generic path:
lock the keys' rows, count), ``admit`` and ``admit_queued`` (one call of
``durable_admit`` / ``durable_admit_queued`` on PostgreSQL, see
``durable/sql/admit.sql`` and ``queue.sql``), limit overrides, the Retry-After
estimate, and the creation of a run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from django.db import DatabaseError, IntegrityError, OperationalError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Min, Q
from django.utils import timezone

from durable import conf, exceptions
from durable.concurrency import BORROWED_PREFIX, TAG_PREFIX, Quota, Strategy, replaced_error
from durable.status import RunStatus
from durable.stores import orm
from durable.stores.base import LimitChangeRecord, Promotion, RunExists, RunRecord, estimate, group_keys

logger = logging.getLogger(__name__)


class Admission(orm.ORMStore):
    """``DjangoStore``'s admission of starts."""

    @contextmanager
    @orm.kept_connection
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
        Lock = orm.models().ConcurrencyLock
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

    @orm.kept_connection
    def limit_overrides(self, keys: Sequence[str]) -> dict[str, int]:
        rows = orm.models().ConcurrencyLock.objects.using(self.using).filter(key__in=list(keys), limit_override__isnull=False)
        return dict(rows.values_list("key", "limit_override"))

    def set_limit_override(
        self, key: str, limit: int | None, *, reason: str, changed_by: Any = None, changed_by_name: str = ""
    ) -> LimitChangeRecord:
        """Lock the key's row (creating it, with no known limit, for a key no start
        has used yet), write the override and its ``LimitChange``, in one transaction."""
        models = orm.models()
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

    @orm.kept_connection
    def retry_estimate(self, quota: Quota, *, namespace: str | None = None) -> float | None:
        """The generic path's estimate (PostgreSQL's admission functions make their own):
        the key's ``recent_durations`` and the creation of its oldest tag in flight."""
        models = orm.models()
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
        Lock = orm.models().ConcurrencyLock
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

    @orm.kept_connection
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
        # A guess on a start of one key without a burst: its key's last start here was refused?
        hint = (count_namespace, ordered[0].key) if len(ordered) == 1 and ordered[0].burst is None else None
        refused_before = hint is not None and hint in _refused_keys
        if refused_before and not run_id_given:
            self._refuse_if_full(connection, record, ordered[0], count_namespace)
        groups = group_keys([q.tag for q in ordered])
        payload = [{"key": q.key, "limit": q.limit, "statuses": list(q.count_statuses), "group": groups[q.tag]} for q in ordered]
        bursting = [(entry, q.burst) for entry, q in zip(payload, ordered, strict=True) if q.burst is not None]
        for entry, burst in bursting:
            entry.update(burst={"pool": burst.pool, "up_to": burst.up_to}, pool_limit=burst.pool_limit)
        if hint is not None and not refused_before and not connection.in_atomic_block:
            payload[0]["lock_first"] = True
        if bursting and connection.in_atomic_block:
            row = self._admit_in_transaction(connection, payload, record, count_namespace, run_id_given, ordered)
        else:
            row = self._admit_in_key_order(connection, payload, record, count_namespace, run_id_given, ordered)
        outcome, key, limit, active, _, durations, oldest_age, burst_detail = row[:8]
        if hint is not None:
            _refused_keys.note(hint, refused=outcome == "full")
        burst_detail = orm.decoded(burst_detail)
        if outcome == "full":  # the function recorded the refused limits already
            raise _refusal(record, key, limit, active, durations, oldest_age, burst_detail)
        if outcome == "exists":
            raise RunExists(record.run_id)
        if burst_detail:
            # The function answers which keys borrowed: a key on a used pool may be within its limit.
            borrowed = [TAG_PREFIX + pool for pool in burst_detail["borrowed"]]
            borrowed += [BORROWED_PREFIX + key for key in burst_detail["keys"]]
            record.tags = list(dict.fromkeys([q.tag for q in ordered] + borrowed))
        return True

    def _refuse_if_full(
        self, connection: BaseDatabaseWrapper, record: RunRecord, quota: Quota, count_namespace: str | None
    ) -> None:
        """Raise ``ConcurrencyLimitError`` when the committed count of ``quota``'s key fills it
        and its row records these limits already (``durable_full_key``: one plain query, without
        the quotas' JSON nor the run's input); return when it may have room, for ``durable_admit``."""
        with connection.cursor() as cursor:
            cursor.execute(FULL_KEY_SQL, full_key_params(quota, count_namespace))
            row = cursor.fetchone()
        if row is not None:
            active, limit, durations, oldest_age = row
            raise _refusal(record, quota.key, limit, active, durations, oldest_age, None)

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

    @orm.kept_connection
    def admit_queued(
        self,
        record: RunRecord,
        quotas: Sequence[Quota],
        *,
        count_namespace: str | None,
        run_id_given: bool = False,
        ancestors: Sequence[RunRecord] = (),
        superseded: list[RunRecord] | None = None,
        promotion: Promotion | None = None,
    ) -> bool:
        """The admission of a start whose quotas are REJECT and/or the queueing
        strategies in one round trip, on PostgreSQL (the function
        ``durable_admit_queued``): it decides as ``admission.decide`` does, creates
        the run ``pending``, ``queued`` or ``cancelled`` (``record`` is updated) and
        cancels the queued runs it replaces (appended to ``superseded``). False when
        this database has no such path. Raises ``ConcurrencyLimitError``
        (``ConcurrencyQueueFullError``) or ``RunExists``.

        ``promotion``: a start of its own (no transaction of the caller's) whose
        quotas are REJECT and GROUP_ROUND_ROBIN, without a run id of the caller's,
        sends the promote its run needs if queued in the same round trip, after its
        commit: ``<durable_admit_queued>; COMMIT; <durable_promote if the run is
        queued>``, one statement list, where the COMMIT ends the start's transaction
        and the promote runs in one of its own, as it would on commit. Only with
        psycopg's client-side binding (Django's default): a connection that binds on
        the server sends one statement per call, and the promote follows on commit."""
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
        sql = "SELECT * FROM durable_admit_queued(%s::jsonb, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s::jsonb)"
        params = [
            json.dumps(payload),
            *_start_params(record, count_namespace, run_id_given),
            json.dumps([{"run_id": a.run_id, "status": str(a.status)} for a in ancestors]),
        ]
        with connection.cursor() as cursor:
            if not (
                promotion is not None
                and not run_id_given
                and {q.strategy for q in quotas} <= _PROMOTED_AFTER_COMMIT
                and _lists_in_one_call(connection, cursor)
            ):
                promotion = None
            if promotion is not None:
                sql = f"{sql}; COMMIT; {_PROMOTE_IF_QUEUED}"
                params += [json.dumps(promotion.keys), None, promotion.namespace, None, timezone.now(), True, record.run_id]
            try:
                cursor.execute(sql, params)
            except DatabaseError:
                if promotion is None or not self._created_queued(record):
                    raise
                # The start committed and the promote after it failed: the engine promotes again.
                logger.warning("The promote after queued run %s's start failed; it is made again.", record.run_id, exc_info=True)
                return True
            row = cursor.fetchone()
            if promotion is not None and cursor.nextset() and cursor.nextset():  # the COMMIT's, then the promote's
                _promoted(promotion, cursor.fetchone())
        outcome, status, key, limit, active, queued, max_queued, reason, holder, durations, oldest_age = row[:11]
        run_error, finished_at, cancelled = row[11:]
        if outcome == "created":
            record.status = status
            if status == RunStatus.CANCELLED:
                record.error, record.finished_at = orm.decoded(run_error), finished_at
            if superseded is not None:
                superseded.extend(orm.run_record(run) for run in orm.decoded(cancelled) or [])
            return True
        if outcome == "exists":
            raise RunExists(record.run_id)
        seconds = conf.retry_after_seconds(estimate(orm.decoded(durations), oldest_age))
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

    def _created_queued(self, record: RunRecord) -> bool:
        """After ``admit_queued``'s statement list failed: whether its start committed before
        the failure (its run exists), ``record``'s status then set from the run."""
        try:
            status = self._runs().filter(run_id=record.run_id).values_list("status", flat=True).first()
        except DatabaseError:
            return False  # the connection is lost: the start's outcome is not known
        if status is None:
            return False
        record.status = RunStatus(status)
        return True

    @orm.kept_connection
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
        table = connection.ops.quote_name(orm.models().WorkflowRun._meta.db_table)
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

    @orm.kept_connection
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


class _RefusedKeys:
    """The keys (with the namespace counted in) whose last start in this process was
    refused by ``durable_admit``, the ``size`` newest: a guess, never a decision.

    A start of one key without a burst, outside the caller's transaction, asks
    ``durable_admit`` to take the key's row first (``lock_first``: if no one holds
    it) and count once, under the lock, unless the key is here: then (unless the
    caller chose the run id) ``durable_full_key`` first refuses it if the key is
    still full, in one plain query that sends neither the quotas' JSON nor the
    run's input; a key with room again is then admitted by ``durable_admit``,
    which counts first, as every start did before 0026, so that starts into a full
    hot key take no lock. A wrong guess costs only time: a start into a full key
    that took the lock is refused all the same (its transaction, the call's own,
    then writes the lock), and a start into a key with room that was refused
    before makes one query more and counts twice."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._keys: OrderedDict[tuple[str | None, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str | None, str]) -> bool:
        return key in self._keys

    def note(self, key: tuple[str | None, str], *, refused: bool) -> None:
        with self._lock:
            if not refused:
                self._keys.pop(key, None)
                return
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self.size:
                self._keys.popitem(last=False)


_refused_keys = _RefusedKeys()

#: PostgreSQL's SQLSTATE of a NOWAIT lock that is busy (durable_admit's pool lock out of key order).
_LOCK_NOT_AVAILABLE = "55P03"
#: The pauses between the calls of ``durable_admit`` that find a burst pool busy inside
#: the caller's transaction (4 calls in about 0.2 s), before ``PoolBusyError``.
_POOL_BACKOFF = (0.02, 0.05, 0.1)
#: durable_admit's DETAIL of a busy pool inside a transaction that held no lock before the call.
_NOTHING_HELD = "durable: nothing held"


#: The strategies whose ``admit_queued`` may send the promote a queued run needs in its own
#: round trip: if that promote fails, the start is read back whole from its run (a strategy
#: that cancels queued runs would lose which; a run id of the caller's, whose run it is).
_PROMOTED_AFTER_COMMIT = frozenset({Strategy.REJECT, Strategy.GROUP_ROUND_ROBIN})
#: The call of ``durable_promote`` (keys, run id, namespace counted in, keys to lock first,
#: now, whether to commit asynchronously): ``DjangoStore.promote``'s, and a queued start's.
PROMOTE_SQL = "SELECT durable_promote(%s::jsonb, %s, %s, %s::jsonb, %s, %s)"
#: The promote of a queued start's keys, as ``Promoter.promote`` makes it on the start's commit
#: (async commit: a transaction of its own), if its run (the last parameter) is still queued:
#: after the start's ``COMMIT`` in the same statement list.
_PROMOTE_IF_QUEUED = f"{PROMOTE_SQL} FROM durable_workflowrun WHERE run_id = %s AND status = 'queued'"


def _lists_in_one_call(connection: BaseDatabaseWrapper, cursor: Any) -> bool:
    """Whether ``cursor`` sends a list of statements in one call, each ending its transaction
    where the list says: psycopg 3's client-side binding (Django's default) on a connection
    in autocommit, outside any transaction of the caller's."""
    psycopg = sys.modules.get("psycopg")
    return (
        psycopg is not None
        and isinstance(getattr(cursor, "cursor", None), psycopg.ClientCursor)
        and connection.get_autocommit()
        and not connection.in_atomic_block
    )


def promote_answer(value: Any) -> tuple[list[RunRecord], list[str] | None]:
    """``durable_promote``'s answer: the runs it made pending, and the keys to lock first in
    another call (None: done; a lock out of key order was busy otherwise)."""
    answer = orm.decoded(value)
    return [orm.run_record(row) for row in answer["started"]], answer["retry"]


def _promoted(promotion: Promotion, row: tuple[Any, ...] | None) -> None:
    """Record on ``promotion`` the answer of the promote after a queued start (``row``; None:
    the run was no longer queued, nothing to do): the runs it made pending, and whether it is
    done (else ``Promoter.promote`` makes it again, on the start's commit)."""
    if row is None:
        promotion.done = True
        return
    started, retry = promote_answer(row[0])
    promotion.started.extend(started)
    promotion.done = retry is None


#: The statement of ``_refuse_if_full`` (and of the benchmark's row that measures it alone).
FULL_KEY_SQL = "SELECT * FROM durable_full_key(%s, %s, %s::jsonb, %s)"


def full_key_params(quota: Quota, count_namespace: str | None) -> list[Any]:
    """``FULL_KEY_SQL``'s parameters for a start of ``quota``'s key."""
    return [quota.key, quota.limit, json.dumps(list(quota.count_statuses)), count_namespace]


def _refusal(
    record: RunRecord,
    key: str,
    limit: int,
    active: int,
    durations: Any,
    oldest_age: float | None,
    burst_detail: dict[str, Any] | None,
) -> exceptions.ConcurrencyLimitError:
    """The error of a start refused by the admission functions' answer, with its Retry-After."""
    seconds = conf.retry_after_seconds(estimate(orm.decoded(durations), oldest_age))
    return exceptions.ConcurrencyLimitError(
        workflow=record.workflow, key=key, limit=limit, active=active, retry_after=seconds, **(burst_detail or {})
    )


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
