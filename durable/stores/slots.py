"""Step-level quotas on Django's ORM (PostgreSQL and SQLite): ``DjangoStore``'s
``acquire_slot``, ``release_slot``, ``release_run_slots``, ``hand_off_key_slots`` and
``hand_off_slots``.

Every write that can change a key's count of ``StepSlot`` rows happens under the
lock of the key's ``ConcurrencyLock`` row (SELECT ... FOR UPDATE), the row run
admission locks (taking up a slot handed to a step only sets its lease, and
deleting rows that no longer count changes no count):
keys are locked one at a time, before any run row, so these never deadlock with
admission, hand-offs of queued runs, or each other. A run row is locked only by
``acquire_slot`` (its own run, to check the lease and park it) and, on PostgreSQL,
by a release waking the runs it handed a slot to, after the key's row; elsewhere
waking them happens after commit, in transactions of their own.

On PostgreSQL taking a slot, a release (with the wake-up of the runs handed a
slot, ``release_waking``) and a hand-off are one round trip each: the functions
``durable_acquire_slot``, ``durable_release_slot`` and ``durable_slot_hand_off``
(``durable/sql/slots.sql``) do what ``acquire``, ``release`` and ``_hand_off`` do here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import CharField, Exists, F, OuterRef, Q, Value
from django.db.models.functions import Concat, Greatest
from django.utils import timezone

from durable.status import ACTIVE_STATUSES, TERMINAL_STATUSES, RunStatus
from durable.stores import orm
from durable.stores.base import SLOT_WAIT_PREFIX, RunRecord, SlotAnswer

if TYPE_CHECKING:
    from durable.stores.database import DjangoStore

#: Journal outcomes that end a step (a ``waiting`` entry is a sleep or a signal wait).
_ENDED = ("completed", "failed")
#: What durable's slot functions take after p_now: the statuses of a run whose held
#: slot counts, and those of a run whose waiting row is dropped.
_STATUSES = (list(ACTIVE_STATUSES), sorted(TERMINAL_STATUSES))


def _models() -> Any:
    from durable import models

    return models


def _slots(store: DjangoStore) -> Any:
    return _models().StepSlot.objects.using(store.using)


def _lock(store: DjangoStore, key: str, limit: int | None = None) -> int | None:
    """Lock ``key``'s row (creating it, as a start of the key would, when ``limit``
    is given and it is missing); the key's limit override, if any."""
    Lock = _models().ConcurrencyLock
    locks = Lock.objects.using(store.using)
    row = locks.select_for_update().filter(key=key).values_list("limit_override", flat=True)
    found = list(row)
    if not found and limit is not None:
        # No count_statuses: no run is counted under this key unless a start says so.
        # ON CONFLICT DO NOTHING waits for a concurrent insert of the key; then lock
        # the row (a new query: the first one's empty result is cached).
        locks.bulk_create([Lock(key=key, limit=limit, count_statuses=[])], ignore_conflicts=True)
        found = list(row.all())
    return found[0] if found else None


def _held(store: DjangoStore, key: str) -> int:
    """The key's slots in use: held rows whose step is not journaled and whose run is active."""
    journaled = (
        _models()
        .StepRecord.objects.using(store.using)
        .filter(run_id=OuterRef("run_id"), position=OuterRef("position"), outcome__in=_ENDED)
    )
    held = _slots(store).filter(key=key, status="held", run__status__in=ACTIVE_STATUSES)
    return int(held.exclude(Exists(journaled)).count())


def _hand_off(store: DjangoStore, key: str, override: int | None) -> tuple[list[str], int, bool]:
    """Give the key's free slots to its waiters, oldest first (the key is locked).

    Returns the run ids given one, the key's slots in use after that, and whether
    steps still wait. A waiter whose run ended is dropped. The count is made once:
    under the key's lock nothing else takes a slot, and a slot freed meanwhile (a
    journal write, a cancel) is handed on by the release that follows it."""
    woken: list[str] = []
    slots = _slots(store)
    heads = slots.filter(key=key, status="waiting").order_by("id").values_list("id", "limit", "run__status", "run__run_id")
    held: int | None = None
    while True:
        first = heads.all().first()
        if first is None:
            return woken, _held(store, key) if held is None else held, False
        pk, limit, status, run_id = first
        if status in TERMINAL_STATUSES:
            slots.filter(pk=pk).delete()
            continue
        if held is None:
            held = _held(store, key)
        if held >= (limit if override is None else override):
            return woken, held, True
        slots.filter(pk=pk).update(status="held", lease="", granted_at=timezone.now())
        held += 1
        woken.append(run_id)


def _hand_on(store: DjangoStore, key: str, override: int | None) -> list[str]:
    """``_hand_off``'s run ids given a slot (the key is locked): on PostgreSQL in one
    statement, ``durable_slot_hand_off``."""
    connection = store._postgres()
    if connection is None:
        return _hand_off(store, key, override)[0]
    with connection.cursor() as cursor:
        cursor.execute("SELECT woken FROM durable_slot_hand_off(%s, %s, %s, %s, %s)", [key, override, timezone.now(), *_STATUSES])
        return list(cursor.fetchone()[0])


def acquire(store: DjangoStore, run_id: str, lease: str, position: int, *, key: str, limit: int, queue: bool) -> SlotAnswer:
    connection = store._postgres()
    if connection is not None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT durable_acquire_slot(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                [run_id, lease, position, key, limit, queue, timezone.now(), *_STATUSES],
            )
            answer = orm.decoded(cursor.fetchone()[0])
        return SlotAnswer(answer["outcome"], answer["active"], answer["limit"], tuple(answer["woken"]))
    slots = _slots(store)
    # The slot handed to this step while its run was parked: take it up in one
    # statement, without the key's lock (the key's count does not change).
    mine = slots.filter(run__run_id=run_id, run__status=RunStatus.RUNNING, run__lease=lease, position=position)
    if mine.filter(key=key, status="held", lease__in=["", lease]).update(lease=lease):
        return SlotAnswer("held", limit=limit)
    with transaction.atomic(using=store.using):
        override = _lock(store, key, limit)
        in_effect = limit if override is None else override
        run = store._runs().select_for_update().filter(run_id=run_id, status=RunStatus.RUNNING, lease=lease)
        pk = run.values_list("pk", flat=True).first()
        if pk is None:
            return SlotAnswer("lost")
        found = slots.filter(run_id=pk, position=position).values_list("id", "key", "status", "lease").first()
        if found is not None:
            row, its_key, status, holder = found
            if its_key == key and status == "held" and holder in ("", lease):
                if holder != lease:
                    slots.filter(pk=row).update(lease=lease)
                return SlotAnswer("held", limit=in_effect)
            # Held by a dead execution of this run (taken over): free it, ask again
            # behind the waiters. A waiting row (its run woken otherwise): ask again.
            slots.filter(pk=row).delete()
        woken, active, waiting = _hand_off(store, key, override)
        if in_effect > 0 and active < in_effect and not waiting:
            now = timezone.now()
            slots.create(run_id=pk, key=key, position=position, status="held", limit=limit, lease=lease, granted_at=now)
            return SlotAnswer("held", active + 1, in_effect, tuple(woken))
        if not queue or in_effect <= 0:
            return SlotAnswer("full", active, in_effect, tuple(woken))
        slots.create(run_id=pk, key=key, position=position, status="waiting", limit=limit)
        store._set_status(
            store._runs().filter(pk=pk),
            RunStatus.SUSPENDED,
            waiting_for=SLOT_WAIT_PREFIX + key,
            wake_at=None,
            lease="",
            # Parking undoes its own claim's count, not an earlier death's: a takeover
            # that frees a dead execution's slot and parks behind the waiters keeps
            # the death counted, so a step that keeps killing its worker ends dead.
            attempt=Greatest(F("attempt") - 1, Value(0)),
        )
        return SlotAnswer("waiting", active, in_effect, tuple(woken))


def release_waking(store: DjangoStore, run_id: str, position: int, *, key: str, lease: str) -> tuple[list[RunRecord], list[str]]:
    connection = store._postgres()
    if connection is None:
        return [], release(store, run_id, position, key=key, lease=lease)
    return _release_call(connection, run_id, position, key, lease, wake=True)


def _release_call(
    connection: Any, run_id: str, position: int, key: str, lease: str, *, wake: bool
) -> tuple[list[RunRecord], list[str]]:
    """One call of ``durable_release_slot``: the runs it made pending (``wake``), the run ids to wake."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT durable_release_slot(%s, %s, %s, %s, %s, %s, %s, %s)",
            [run_id, position, key, lease, timezone.now(), *_STATUSES, wake],
        )
        answer = orm.decoded(cursor.fetchone()[0])
    return [orm.run_record(row) for row in answer["started"]], list(answer["wake"])


def release(store: DjangoStore, run_id: str, position: int, *, key: str, lease: str) -> list[str]:
    connection = store._postgres()
    if connection is not None:
        return _release_call(connection, run_id, position, key, lease, wake=False)[1]
    mine = _slots(store).filter(run__run_id=run_id, position=position, key=key, lease=lease, status="held")
    with transaction.atomic(using=store.using):
        override = _lock(store, key)
        if not mine.delete()[0]:
            return []  # a takeover freed it already
        return _hand_off(store, key, override)[0]


def release_run(store: DjangoStore, run_id: str) -> list[tuple[str, str]]:
    # Only while the run is ended: once retried, its rows (the retry deleted the old
    # ones) are its new execution's, which a late release must leave alone.
    ended = _slots(store).filter(run__run_id=run_id, run__status__in=TERMINAL_STATUSES)
    keys = sorted(set(ended.values_list("key", flat=True)))
    woken: list[tuple[str, str]] = []
    for key in keys:  # one key at a time, as admission locks them
        with transaction.atomic(using=store.using):
            override = _lock(store, key)
            ended.filter(key=key).delete()
            woken += [(key, r) for r in _hand_on(store, key, override)]
    return woken


def hand_off_keys(store: DjangoStore, keys: Sequence[str]) -> list[tuple[str, str]]:
    slots = _slots(store)
    waited = set(slots.filter(key__in=list(keys), status="waiting").values_list("key", flat=True))
    woken: list[tuple[str, str]] = []
    for key in sorted(waited):  # one key at a time, as admission locks them
        with transaction.atomic(using=store.using):
            override = _lock(store, key)
            woken += [(key, r) for r in _hand_on(store, key, override)]
    return woken


def hand_off_all(store: DjangoStore) -> list[tuple[str, str]]:
    slots = _slots(store)
    journaled = (
        _models()
        .StepRecord.objects.using(store.using)
        .filter(run_id=OuterRef("run_id"), position=OuterRef("position"), outcome__in=_ENDED)
    )
    # Rows that no longer count (journaled steps, ended runs), left by a release
    # lost in a crash: deleting them changes no count, so it needs no key's lock.
    stale = slots.filter(status="held").filter(Exists(journaled) | ~Q(run__status__in=ACTIVE_STATUSES))
    slots.filter(pk__in=list(stale.values_list("pk", flat=True)[:1000])).delete()
    woken: list[tuple[str, str]] = []
    for key in sorted(set(slots.filter(status="waiting").values_list("key", flat=True))):
        with transaction.atomic(using=store.using):
            override = _lock(store, key)
            woken += [(key, r) for r in _hand_on(store, key, override)]
    # Runs handed a slot whose wake-up was lost (a crash right after the hand-off committed).
    parked = (
        slots.filter(status="held", run__status=RunStatus.SUSPENDED)
        .annotate(awaited=Concat(Value(SLOT_WAIT_PREFIX), "key", output_field=CharField()))
        .filter(run__waiting_for=F("awaited"))
    )
    woken += [(key, run_id) for key, run_id in parked.values_list("key", "run__run_id")[:1000] if (key, run_id) not in woken]
    return woken
