"""The store contract: everything the engine needs from persistence.

``BaseStore`` states every capability the engine uses. ``DjangoStore`` (the
default) and ``InMemoryStore`` subclass it, and so does a custom store: it
implements the methods that raise ``NotImplementedError`` here and may keep the
defaults of the others (``count_runs`` counts ``len(list_runs(...))``, ``admit``
leaves admission to the engine's generic path, ``claim_journal`` claims without
reading the journal, ``run_exists`` asks ``get_run``,
``waiting_parents`` finds none, ``recover`` and ``release_thread`` do nothing,
a store without ``limit_overrides`` has none, without ``retry_estimate`` estimates nothing).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from durable.concurrency import Quota
from durable.status import RunStatus


@dataclass(frozen=True)
class Finished:
    """What ``BaseStore.finish`` may answer for a run it ended, instead of ``True``:
    ``hand_off=False`` says no hand-off to queued runs follows its end: it held no
    quota key, or (on PostgreSQL, ``durable_end``) no key of it has a queued run,
    checked under the keys' locks; ``held_slots=False`` says it had no step slot
    row (held or waiting), so there is no step slot to hand on. A plain ``True``
    means both may follow."""

    hand_off: bool = True
    held_slots: bool = True

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class SlotAnswer:
    """What ``BaseStore.acquire_slot`` answers.

    ``outcome``: ``"held"`` (the step runs its body now), ``"waiting"`` (the run
    is parked ``suspended``, waiting for ``slot:<key>``), ``"full"`` (the key is
    full and the step does not wait: nothing was written), ``"lost"`` (the run no
    longer belongs to the lease). ``active``, ``limit``: the key's held slots
    (counted for a new slot, a wait or a refusal; 0 when the step's own slot was
    found again) and the limit in effect. ``woken``: runs handed a slot meanwhile, to wake.
    """

    outcome: str
    active: int = 0
    limit: int = 0
    woken: tuple[str, ...] = ()


#: What a run parked for a slot of ``key`` waits for (``RunRecord.waiting_for``).
SLOT_WAIT_PREFIX = "slot:"


class RunExists(Exception):
    """Raised by ``create_run`` (or when leaving ``admission``) for a run id taken already."""


@dataclass
class RunRecord:
    run_id: str
    workflow: str
    version: str
    namespace: str
    status: str
    input: Any = None
    output: Any = None
    error: Any = None
    attempt: int = 0
    generation: int = 0
    parent_run_id: str | None = None
    queue: str = ""
    waiting_for: str = ""
    wake_at: datetime | None = None
    lease: str = ""
    worker: str = ""
    created_at: datetime | None = None
    updated_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    heartbeat_at: datetime | None = None
    dispatched_at: datetime | None = None
    redispatches: int = 0
    tags: list[str] = field(default_factory=list)
    #: The start counted its quotas in ``namespace`` only (``scope_reads``); its children count so too.
    fenced: bool = False


@dataclass
class Promotion:
    """The promote a queued start needs once it has committed (a slot may have freed
    between its count and its commit), which a store's ``admit_queued`` may make in the
    start's own round trip: the keys and namespace ``admission.Promoter`` would promote
    in. The store sets ``done`` when it promoted them all, and appends the runs it made
    pending to ``started``, for the engine to send."""

    keys: list[str]
    namespace: str | None
    done: bool = False
    started: list[RunRecord] = field(default_factory=list)


@dataclass(frozen=True)
class LimitChangeRecord:
    """One change of a key's limit override (``BaseStore.set_limit_override``):
    the override and the limit in effect before and after (an override of None:
    none, the code's limit applies; a limit of None: not known yet)."""

    key: str
    old_override: int | None
    new_override: int | None
    old_limit: int | None
    new_limit: int | None
    reason: str
    changed_by_name: str = ""
    changed_at: datetime | None = None


@dataclass(frozen=True)
class StepEntry:
    position: int
    name: str
    outcome: str  # "completed" | "failed"
    output: Any = None
    error: Any = None
    attempts: int = 1
    started_at: datetime | None = None


class BaseStore:
    """Where runs live: every capability the engine uses.

    A store subclasses this. The methods that raise ``NotImplementedError`` are
    required; the others have a generic default that a store may override with
    a faster or stronger one (``DjangoStore`` does).
    """

    # -- reads -------------------------------------------------------------
    def get_run(self, run_id: str) -> RunRecord | None:
        raise NotImplementedError

    def settled_run(self, run_id: str) -> RunRecord | None:
        """The run once no transaction still changing it is left: a store whose writers
        can be in flight while it reads waits for them (``DjangoStore`` waits for the
        run's row lock), so a compare-and-set that follows sees what they committed.
        Default: ``get_run`` (a store whose changes are atomic to its readers)."""
        return self.get_run(run_id)

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> list[RunRecord]:
        raise NotImplementedError

    def count_runs(
        self,
        *,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> int:
        """What a quota counts. Default: ``len(list_runs(...))``; a store overrides
        it with one ``COUNT(*)``."""
        return len(self.list_runs(tag=tag, statuses=statuses, namespace=namespace))

    # -- admission ---------------------------------------------------------
    def admission(self, quotas: Sequence[Quota]) -> AbstractContextManager[Sequence[Quota] | None]:
        """One transaction holding the lock of every quota's key (in key order).

        It yields ``quotas`` with the limit in effect on each key, read under its
        lock (an operator's override replacing the code's limit), or None when
        the store has no overrides (the engine then applies ``quotas`` as given).
        """
        raise NotImplementedError

    def limit_overrides(self, keys: Sequence[str]) -> dict[str, int]:
        """The limit overrides set on ``keys`` (``set_limit_override``), by key,
        read without a lock. Default: none."""
        return {}

    def set_limit_override(
        self, key: str, limit: int | None, *, reason: str, changed_by: Any = None, changed_by_name: str = ""
    ) -> LimitChangeRecord:
        """Set (or with None clear) the limit override of ``key`` and record the
        change, in one transaction holding the key's lock (creating its row if
        needed): the next admission of the key applies it. ``changed_by``: the
        user, where the store keeps users (``DjangoStore``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot override limits.")

    def retry_estimate(self, quota: Quota, *, namespace: str | None = None) -> float | None:
        """Seconds until a slot of ``quota``'s full key should free: the median of
        its recent run durations minus the age of its oldest run in flight
        (counted in ``namespace``); None when nothing is measured. Default: None."""
        return None

    def admit(
        self, record: RunRecord, quotas: Sequence[Quota], *, count_namespace: str | None, run_id_given: bool = False
    ) -> bool:
        """The whole REJECT admission of ``record`` in one go (count every key in
        ``count_namespace``, create the run), or False when this store has no such
        path: the engine then takes its generic one (``admission``, ``count_runs``,
        ``create_run``). Raises ``ConcurrencyLimitError``, or ``RunExists`` for a
        taken run id (``run_id_given``: the caller chose it). Default: False."""
        return False

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
        strategies (GROUP_ROUND_ROBIN, CANCEL_QUEUED_EXCEPT_NEWEST / _OLDEST) in
        one go, deciding as ``admission.decide`` does (``ancestors``: a child
        start's parent, its parent...): create the run ``pending``, ``queued`` or
        ``cancelled`` and set ``record.status`` (and its ``error`` and
        ``finished_at`` when cancelled); cancel the queued runs the start replaces
        (with ``concurrency.replaced_error``) and append them, as cancelled, to
        ``superseded`` for the engine to finish their cancel. False when this store
        has no such path (the engine takes its generic one). Raises as ``admit``,
        and ``ConcurrencyQueueFullError``. ``promotion``: the promote a run created
        queued needs after the commit, which the store may make too (see
        ``Promotion``). Default: False."""
        return False

    def run_exists(self, run_id: str) -> bool:
        """Whether a run has this id, once any start of it not yet committed has
        ended (a refused start checks it). Default: ``get_run``."""
        return self.get_run(run_id) is not None

    def create_run(self, record: RunRecord, tags: Sequence[str]) -> None:
        """Insert the run (with the status, error and times of ``record``) and its tags."""
        raise NotImplementedError

    def on_commit(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` once the current transaction commits (at once outside one)."""
        raise NotImplementedError

    # -- state changes (compare-and-set) -----------------------------------
    def transition(
        self,
        run_id: str,
        *,
        from_statuses: Sequence[str],
        to: str,
        expect: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> bool:
        """Compare-and-set: move the run to ``to`` (setting ``fields``) only if its
        status is in ``from_statuses`` and its fields equal ``expect``."""
        raise NotImplementedError

    def claim(self, run_id: str, *, lease: str, worker: str, stale_before: datetime) -> RunRecord | None:
        """Take a pending run (or a running one whose heartbeat is older than
        ``stale_before``) for ``lease``; None when it is not to be executed."""
        raise NotImplementedError

    def claim_journal(
        self, run_id: str, *, lease: str, worker: str, stale_before: datetime
    ) -> tuple[RunRecord, list[StepEntry] | None] | None:
        """``claim``, reading the run's journal in the same call where the store can:
        the run and its steps, or the run and None (the engine then calls
        ``load_steps``); None when it is not to be executed. Default: ``claim``
        without the journal."""
        record = self.claim(run_id, lease=lease, worker=worker, stale_before=stale_before)
        return None if record is None else (record, None)

    def unclaim(self, run_id: str, lease: str) -> bool:
        """Hand a run back ``pending`` from the claim made under ``lease`` (a
        compare-and-set on it), with the attempt that claim counted taken back: for
        an execution a lost connection ended, perhaps the claim's own (it committed,
        its answer was lost). False when the run is not ``running`` under ``lease``."""
        record = self.get_run(run_id)
        if record is None or record.status != RunStatus.RUNNING or record.lease != lease:
            return False
        return self.transition(
            run_id,
            from_statuses=[RunStatus.RUNNING],
            to=RunStatus.PENDING,
            expect={"lease": lease, "attempt": record.attempt},
            lease="",
            attempt=max(0, record.attempt - 1),
        )

    def holds(self, run_id: str, lease: str) -> bool:
        """Whether the run is ``running`` under ``lease`` (an execution's lease check).
        Default: reads the run (``get_run``)."""
        record = self.get_run(run_id)
        return record is not None and record.status == RunStatus.RUNNING and record.lease == lease

    def heartbeat(self, run_id: str, lease: str) -> bool:
        raise NotImplementedError

    def finish(self, run_id: str, lease: str, *, status: str, output: Any = None, error: Any = None) -> bool | Finished:
        """Compare-and-set a run running under ``lease`` to the terminal ``status``;
        falsy when it no longer belongs to ``lease``, else ``True`` or a ``Finished``."""
        raise NotImplementedError

    def retry(self, run_id: str, *, from_statuses: Sequence[str], tags: Sequence[str]) -> bool:
        """Compare-and-set the run back to ``pending`` with ``tags``, dropping the
        failure that ended it (the last journal entry, when the run ``failed`` and
        that entry is a failed step: failures the workflow caught before stay, and
        replay as they did) and its step slot rows (a slot it was handed before it ended
        counts no more; its replay asks the key again)."""
        raise NotImplementedError

    # -- journal -------------------------------------------------------------
    def load_steps(self, run_id: str) -> list[StepEntry]:
        raise NotImplementedError

    def record_step(self, run_id: str, lease: str, step: StepEntry) -> bool:
        """Journal ``step`` (replacing a ``waiting`` entry at its position); False when
        the run no longer belongs to ``lease``."""
        raise NotImplementedError

    # -- waiting -----------------------------------------------------------------
    def suspend(self, run_id: str, lease: str, *, waiting_for: str, wake_at: datetime | None) -> bool:
        """Park the run ``suspended``, unless what it waits for (a buffered signal, a
        finished child) is already there: then return False and leave it running."""
        raise NotImplementedError

    def add_signal(self, run_id: str, name: str, payload: Any) -> RunRecord | None:
        """Buffer a signal for the run (holding its row, so a concurrent ``suspend``
        sees it); the run as it was, or None when there is no such run."""
        raise NotImplementedError

    def consume_signal(self, run_id: str, lease: str, name: str, step: StepEntry) -> tuple[bool, Any]:
        """Take the oldest buffered signal ``name`` and journal ``step`` with its payload, atomically."""
        raise NotImplementedError

    def active_children(self, run_id: str) -> list[RunRecord]:
        raise NotImplementedError

    def due_runs(self, now: datetime) -> list[RunRecord]:
        """Suspended runs whose ``wake_at`` has come."""
        raise NotImplementedError

    def waiting_parents(self) -> list[RunRecord]:
        """Suspended runs waiting for a child that has ended (its wake-up was lost),
        for the sweeper. Default: none (a lost wake-up then waits for a signal or a retry)."""
        return []

    def runs_on_queues(self, statuses: Sequence[str]) -> list[RunRecord]:
        """Runs in ``statuses`` whose messages go to a queue of their own (remote workflows)."""
        raise NotImplementedError

    # -- strategies ------------------------------------------------------------
    def run_keys(self, run_id: str) -> list[str]:
        """The concurrency keys of a run (its ``concurrency:`` tags, without the prefix)."""
        raise NotImplementedError

    def quota_settings(self, keys: Sequence[str]) -> dict[str, tuple[int | None, tuple[str, ...]]]:
        """The last ``(limit, count_statuses)`` a start used for each key."""
        raise NotImplementedError

    def queued_heads(self, tag: str, *, namespace: str | None = None) -> list[tuple[str, str]]:
        """``(group, run_id)`` of the oldest queued run of each group queued on ``tag``."""
        raise NotImplementedError

    def rr_cursor(self, key: str) -> str:
        """The group the last hand-off of ``key`` served ("" for none)."""
        raise NotImplementedError

    def set_rr_cursor(self, key: str, group: str) -> None:
        raise NotImplementedError

    def promote(
        self, keys: Sequence[str] = (), *, run_id: str | None = None, count_namespace: str | None = None
    ) -> list[RunRecord] | None:
        """What ``admission.Promoter.promote`` does, in one go: hand the free slots
        of ``keys``, then of the keys of run ``run_id`` (one that left its slots),
        to their queued runs, counted in ``count_namespace``; return the runs made
        ``pending`` (the caller sends them). None when this store has no such path
        (the promoter takes its generic one). Default: None."""
        return None

    def keys_with_queued(self) -> dict[str, list[str]]:
        """The keys that have queued runs, by the namespace of those runs."""
        raise NotImplementedError

    # -- step-level quotas ------------------------------------------------------
    def acquire_slot(self, run_id: str, lease: str, position: int, *, key: str, limit: int, queue: bool) -> SlotAnswer:
        """Under the lock of ``key``'s row: take a slot for the step at ``position``
        of a run running under ``lease``, or (``queue``) park the run ``suspended``
        behind the key's waiters, in one transaction.

        The step's own row is found again on a replay: held with no lease (handed
        to it) or its lease, it is the step's; held under another lease, a dead
        execution's, it is freed (handed on) and the step asks again behind the
        waiters. Free slots go to the waiters first, oldest first: a step is given
        one only when none waits. The limit in effect is the key's override when
        an operator set one. A held slot counts while its step's result is not
        journaled and its run is active."""
        raise NotImplementedError(f"{type(self).__name__} has no step-level quotas.")

    def release_slot(self, run_id: str, position: int, *, key: str, lease: str) -> list[str]:
        """The step at ``position`` ended (journaled, or its run stopped): delete its
        slot of ``key`` if ``lease`` holds it and hand the key's free slots to its waiters, under
        the key's lock; the runs handed a slot, to wake (``SLOT_WAIT_PREFIX`` + key)."""
        raise NotImplementedError(f"{type(self).__name__} has no step-level quotas.")

    def release_slot_waking(self, run_id: str, position: int, *, key: str, lease: str) -> tuple[list[RunRecord], list[str]]:
        """``release_slot``, moving the runs handed a slot back to ``pending`` in the
        same call where the store can: the runs made pending (for the caller to send),
        and the run ids still to wake. Default: ``release_slot``, none made pending
        (``DjangoStore`` wakes them inside ``durable_release_slot`` on PostgreSQL)."""
        return [], self.release_slot(run_id, position, key=key, lease=lease)

    def release_run_slots(self, run_id: str) -> list[tuple[str, str]]:
        """A run ended (finished with step slot rows, or cancelled): delete its slot
        rows and hand their keys' free slots on; ``(key, run id)`` of the runs
        handed one. Nothing if the run is no longer ended (retried since: its
        rows are its new execution's). Default: none held."""
        return []

    def hand_off_key_slots(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """The limits of ``keys`` changed (an operator's override): hand their free
        step slots to their waiting steps, under each key's lock; ``(key, run id)``
        of the runs handed one. Default: none."""
        return []

    def hand_off_slots(self) -> list[tuple[str, str]]:
        """For the sweeper: hand the free slots of every key with waiters on (a
        release lost in a crash); ``(key, run id)`` of the runs handed one, and of
        runs still parked although a slot was handed to them (a lost wake-up).
        Default: none."""
        return []

    # -- recovery ------------------------------------------------------------
    def orphaned_runs(self, heartbeat_before: datetime, dispatched_before: Sequence[datetime] = ()) -> list[RunRecord]:
        """Running runs whose heartbeat is older than ``heartbeat_before``; when
        ``dispatched_before`` is given, only those not re-sent since their claim or
        whose last re-send is due for another (see ``undelivered_runs``)."""
        raise NotImplementedError

    def undelivered_runs(self, dispatched_before: Sequence[datetime]) -> list[RunRecord]:
        """Pending runs due for a re-send: a run re-sent ``n`` times already is due
        when its last message was sent before ``dispatched_before[n]`` (the last
        cutoff for any larger ``n``); see ``redispatch_cutoffs``."""
        raise NotImplementedError

    def mark_dispatched(self, run_ids: Sequence[str]) -> None:
        """The sweeper re-sent these runs now: set ``dispatched_at``, count the re-send."""
        raise NotImplementedError

    # -- connections -----------------------------------------------------------
    def purge_finished(self, before: Mapping[str, datetime], *, limit: int) -> list[str]:
        """Delete at most ``limit`` finished runs (``before``: ``{terminal status:
        finished before}``) with their steps, tags and signals, never one with an
        unfinished child; return their run ids. The sweeper's ``RETENTION``.
        Default: delete nothing (the store keeps every run)."""
        return []

    def recover(self) -> bool:
        """After an error of the store's own calls: drop a connection it left unusable,
        so that the next call opens a fresh one. Default: nothing to do."""
        return True

    def release_thread(self) -> None:
        """A helper thread (a heartbeat) ends: close what it opened. Default: nothing."""

    def keep_connection(self) -> AbstractContextManager[None]:
        """Around one execution (or wake-up) in a worker that closes the project's
        database connections around every task (Celery's Django fix-up): the store may
        run the execution's own statements on a connection it keeps across
        executions (``DjangoStore`` on PostgreSQL: ``durable.stores.kept``).
        Default: nothing changes."""
        return contextlib.nullcontext()


#: The sweeper's re-sends of one run wait ``REDISPATCH_AFTER * 2**n`` after the
#: previous message, with ``n`` at most this (64 times ``REDISPATCH_AFTER``).
REDISPATCH_BACKOFF_CAP = 6


def redispatch_cutoffs(now: datetime, redispatch_after: float) -> list[datetime]:
    """For ``n`` = 0 .. ``REDISPATCH_BACKOFF_CAP``: a run re-sent ``n`` times is due
    again when its last message is older than the ``n``-th datetime."""
    return [now - timedelta(seconds=redispatch_after * 2**n) for n in range(REDISPATCH_BACKOFF_CAP + 1)]


def group_keys(tags: Sequence[str]) -> dict[str, str]:
    """For each tag, the group of its run for round-robin hand-off: the run's other tags."""
    return {tag: "|".join(sorted(t for t in tags if t != tag)) for tag in tags}


#: How many run durations a key keeps for its ``Retry-After`` estimate.
RECENT_DURATIONS = 16
#: A finish records its run's duration only when the key's last one is at least
#: this many seconds old: a sample, which keeps a busy key's row from being
#: rewritten (and its lock taken) by every finish.
DURATION_EVERY = 1.0


def add_duration(durations: Sequence[float] | None, seconds: float) -> list[float]:
    """``durations`` with ``seconds`` appended, keeping the last ``RECENT_DURATIONS``."""
    kept = [*(durations or ()), round(max(0.0, seconds), 3)]
    return kept[-RECENT_DURATIONS:]


def estimate(durations: Sequence[float] | None, oldest_age: float | None) -> float | None:
    """The median of ``durations`` minus ``oldest_age`` (the age of the key's oldest
    run in flight, 0 if none); None when no duration is known."""
    if not durations:
        return None
    return float(statistics.median(durations)) - (oldest_age or 0.0)
