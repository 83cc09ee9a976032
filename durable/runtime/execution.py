"""Executing runs: claim, replay, suspend and resume, finish; and the sweeper.

Every change of a run's state is a compare-and-set in the store, so a duplicate
delivery, a late timer or a second sweeper changes nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django import db
from django.utils import timezone

from durable import exceptions, retention, signals
from durable.concurrency import Quota
from durable.conf import settings
from durable.runtime.context import WorkflowContext
from durable.status import RunStatus
from durable.stores.base import SLOT_WAIT_PREFIX, BaseStore, Finished, RunRecord, StepEntry, redispatch_cutoffs
from durable.util import check_json, describe_error

if TYPE_CHECKING:
    from durable.runtime.engine import Engine

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def store(self) -> BaseStore:
        return self.engine.store

    # -- one execution ---------------------------------------------------------------------
    def execute(self, run_id: str) -> bool:
        """Claim the run and execute (or resume) it.

        Returns True when an infrastructure error (the database or its connection
        failed in one of durable's own calls) interrupted the execution before a
        verdict: the run is handed back ``pending`` where the database allows it,
        and the caller should deliver it again after a delay (else the sweeper
        does). Only the workflow's own exceptions fail a run.
        """
        taken = self._claim(run_id)
        if taken is None:
            return True
        lease, claimed = taken
        if claimed is None:
            logger.debug("Run %s is not pending (or is owned by a live worker); nothing to do.", run_id)
            return False
        record, steps = claimed
        if signals.run_started.has_listeners(self.engine) and record.started_at == record.heartbeat_at:
            # This claim set started_at (the claim sets both to its own now): the run's first execution.
            signals.send_on_commit(
                self.store.on_commit,
                signals.run_started,
                self.engine,
                run_id=run_id,
                workflow=record.workflow,
                version=record.version,
                namespace=record.namespace,
                generation=record.generation,
                started_at=record.started_at,
            )
        try:
            self._execute(record, lease, steps)
        except exceptions.StoreUnavailable as exc:
            return self._interrupted(record, lease, exc.__cause__ or exc)
        except Exception as exc:  # durable's own calls here (journal, suspend, finish)
            return self._interrupted(record, lease, exc)
        return False

    def _claim(self, run_id: str) -> tuple[str, tuple[RunRecord, list[StepEntry] | None] | None] | None:
        """Claim the run under a new lease: (the lease, what ``claim_journal`` answered),
        or None when an infrastructure error prevented the claim. A claim that lost
        its connection (a database restart, a connection dropped while it was idle)
        is tried once more at once, on a new connection."""
        stale_before = timezone.now() - timedelta(seconds=float(settings.STALE_AFTER))
        for tries_left in (1, 0):
            lease = uuid.uuid4().hex
            try:
                return lease, self.store.claim_journal(run_id, lease=lease, worker=_worker_name(), stale_before=stale_before)
            except Exception as exc:
                self._recover()
                transient = isinstance(exc, (db.OperationalError, db.InterfaceError))
                self._release(run_id, lease, unclaim=transient)  # in case the claim committed before the error
                if tries_left and transient:
                    logger.info("Run %s: its claim lost the database connection, claiming it again: %s", run_id, exc)
                    continue
                logger.warning("Run %s could not be claimed, it is delivered again later: %s", run_id, exc)
                break
        return None

    def _execute(self, record: RunRecord, lease: str, steps: list[StepEntry] | None) -> None:
        """Execute a claimed run; ``steps``: its journal when the claim read it."""
        run_id = record.run_id
        if record.attempt > int(settings.MAX_ATTEMPTS):
            message = f"Gave up after {record.attempt - 1} attempts: the worker kept dying."
            self.finish(record, lease, RunStatus.DEAD, error={"type": "durable.dead", "message": message})
            logger.error("Run %s is dead after %d attempts.", run_id, record.attempt - 1)
            return
        try:
            definition = self.engine.registry.get(record.workflow, record.version)
            if definition.fn is None:
                raise exceptions.UnknownWorkflowError(
                    f"Workflow {record.workflow!r} is remote here: its body runs on the workers of queue "
                    f"{definition.queue!r}, which this worker should not consume."
                )
        except exceptions.UnknownWorkflowError as exc:
            if self.finish(record, lease, RunStatus.FAILED, error=describe_error(exc)):
                logger.error("Run %s failed: %s", run_id, exc)
            return
        # Beaten while it runs; lost: the run is no longer this lease's (cancelled, or taken over).
        with heartbeats.beating(self, run_id, lease) as lost:
            claimed = True  # the first pass follows the claim, which just proved the lease
            while True:
                journal = self.store.load_steps(run_id) if steps is None else steps
                steps = None  # a replay reads the journal again
                ctx = WorkflowContext(self.engine, record, lease, journal, lost, claimed=claimed)
                claimed = False
                try:
                    output = definition.fn(ctx, record.input)
                    output = check_json(output, what=f"the output of workflow {record.workflow!r}")
                except exceptions.RunCancelled:
                    logger.info("Run %s stopped: it was cancelled or taken over by another worker.", run_id)
                    return
                except exceptions.Suspend as suspend:
                    wake_at = suspend.wake_at
                    if suspend.parked or self.store.suspend(run_id, lease, waiting_for=suspend.waiting_for, wake_at=wake_at):
                        self._after(record, functools.partial(self._suspended, wake_at=wake_at))
                        return
                    if lost.is_set() or not self.store.holds(run_id, lease):
                        # Cancelled (or taken over) between journaling the wait and parking.
                        logger.info("Run %s stopped before parking: it is no longer this worker's.", run_id)
                        return
                    continue  # what it waits for is already there: replay at once
                except Exception as exc:  # the workflow's own code failed
                    if self.finish(record, lease, RunStatus.FAILED, error=describe_error(exc, with_traceback=True)):
                        # ERROR with the traceback: what Sentry's logging integration and log
                        # aggregation capture (the Celery task itself succeeds, see the docs).
                        logger.error("Run %s of workflow %s failed: %s", run_id, record.workflow, exc, exc_info=exc)
                    else:
                        logger.info("Run %s failed after it stopped being this worker's (cancelled?): %s", run_id, exc)
                    return
                break
        self.finish(record, lease, RunStatus.COMPLETED, output=output)

    def _interrupted(self, record: RunRecord, lease: str, exc: BaseException) -> bool:
        """An infrastructure error ended the execution without a verdict: hand the run
        back ``pending`` so a redelivery resumes it from its journal; if the database
        is still unreachable, the run stays ``running`` without heartbeats and the
        sweeper takes it over after ``STALE_AFTER``.

        A lost or broken database connection does not count as an attempt. Any other
        error of durable's own calls does, so one that repeats on every execution
        ends the run ``dead`` after ``MAX_ATTEMPTS`` instead of looping forever."""
        self._recover()
        transient = isinstance(exc, (db.OperationalError, db.InterfaceError))
        released = self._release(record.run_id, lease, unclaim=transient)
        logger.warning(
            "Run %s was interrupted by an error of durable's own calls%s: %s",
            record.run_id,
            " and is delivered again" if released else "",
            exc,
            exc_info=None if transient else exc,  # not a lost connection: show where it came from
        )
        return released

    def _release(self, run_id: str, lease: str, *, unclaim: bool) -> bool:
        """Hand a run this execution holds back ``pending`` (compare-and-set on the lease);
        with ``unclaim`` (a lost connection ended it), taking back the attempt its claim counted."""
        try:
            if unclaim:
                return self.store.unclaim(run_id, lease)
            return self.store.transition(
                run_id, from_statuses=[RunStatus.RUNNING], to=RunStatus.PENDING, expect={"lease": lease}, lease=""
            )
        except Exception as exc:
            self._recover()
            logger.warning(
                "Run %s could not be handed back after an infrastructure error (%s); if it is running, "
                "the sweeper takes it over after STALE_AFTER.",
                run_id,
                exc,
            )
            return False

    def _recover(self) -> None:
        """Let the store drop a connection an error left unusable (the next call reconnects)."""
        try:
            self.store.recover()
        except Exception:  # closing a dead connection may fail too; the next call reconnects
            logger.debug("Could not close the store's connection", exc_info=True)

    def finish(self, run: RunRecord, lease: str, status: str, *, output: Any = None, error: Any = None) -> bool:
        """End a run this execution holds (compare-and-set on the lease); False if it no longer does."""
        finished = self.store.finish(run.run_id, lease, status=status, output=output, error=error)
        if not finished:
            return False
        hand_off = not isinstance(finished, Finished) or finished.hand_off
        # A step's slot is given back when the step ends (WorkflowContext.step); a run
        # that ends with slot rows (left by a dead execution, or a slot handed to it
        # that its replay never reached) hands them on here.
        slots = not isinstance(finished, Finished) or finished.held_slots
        self._after(run, lambda run: self.ended(run, hand_off=hand_off, slots=slots))
        if signals.run_finished.has_listeners(self.engine):
            send_run_finished(self.engine, run, status, output=output, error=error)
        return True

    @staticmethod
    def _after(run: RunRecord, hook: Callable[[RunRecord], None]) -> None:
        """What follows a committed state change (free slots, wake a parent, set a
        timer) is a fast path: the sweeper does it too, so an error only logs."""
        try:
            hook(run)
        except Exception:
            logger.warning("Run %s: a follow-up of its state change failed; the sweeper covers it.", run.run_id, exc_info=True)

    def ended(self, run: RunRecord, *, hand_off: bool = True, slots: bool = True) -> None:
        """A run reached a terminal status: hand its keys' freed slots on (unless the
        store said no hand-off follows) and its steps' slots (``slots``), wake a parent waiting for it.

        All happen after commit, outside any admission this end is part of (a
        CANCEL_IN_PROGRESS victim), so no keys are locked out of order.
        """
        if hand_off:
            self.released(run)
        if slots:
            run_id = run.run_id
            self.store.on_commit(lambda: self.slots_handed(self.store.release_run_slots(run_id)))
        if run.parent_run_id:
            parent_id, waiting_for = run.parent_run_id, f"child:{run.run_id}"
            self.store.on_commit(lambda: self._wake_parent(parent_id, waiting_for))

    def _wake_parent(self, parent_id: str, waiting_for: str) -> None:
        # Read once the parent's row lock is free: a parent committing its suspension right
        # now (it read this child still running) has committed it, and the compare-and-set
        # sees it suspended. Read before it committed, the parent would look running, the
        # compare-and-set would not wait for it, and the parent would sleep until the sweeper.
        parent = self.store.settled_run(parent_id)
        if parent is not None:
            self.resume(parent, waiting_for=waiting_for)

    def released(self, run: RunRecord) -> None:
        """A run left the counted statuses: hand its keys' free slots to queued runs
        (counted in the run's namespace when reads are fenced), on commit. The
        promoter reads the run's keys itself (on PostgreSQL inside ``durable_promote``)."""
        promoter = self.engine.in_namespace(run.namespace).promoter
        run_id = run.run_id
        self.store.on_commit(lambda: promoter.promote(run_id=run_id))

    def slots_handed(self, woken: Sequence[tuple[str, str]], *, started: Sequence[RunRecord] = ()) -> None:
        """Wake the runs parked for a step slot that was just handed to them
        (``(key, run id)``), and send those the store woke already (``started``,
        made pending with the hand-off); a fast path, the sweeper wakes them too."""
        for pending in started:
            self.engine.dispatch.send(self.engine, pending)
        for key, run_id in woken:
            try:
                run = self.store.get_run(run_id)
                if run is not None:
                    self.resume(run, waiting_for=SLOT_WAIT_PREFIX + key)
            except Exception:
                self._recover()
                logger.warning("Run %s was handed a slot of %s but not woken; the sweeper wakes it.", run_id, key, exc_info=True)

    def _suspended(self, run: RunRecord, wake_at: datetime | None) -> None:
        self.released(run)  # if "suspended" does not count for a key, its slot is free now
        if wake_at is not None:
            # A fast path only: the sweeper wakes due runs from the database too.
            self.engine.dispatch.wake_later(self.engine, run, wake_at)

    def ensure_running(self, run_id: str, lease: str) -> None:
        """Raise ``RunCancelled`` when the run no longer belongs to this execution."""
        if not self.store.holds(run_id, lease):
            raise exceptions.RunCancelled(run_id)

    # -- waking --------------------------------------------------------------------------------
    def resume(self, run: RunRecord, *, waiting_for: str | None = None, due: bool = False) -> bool:
        """Wake a suspended run: compare-and-set on what it waits for (``waiting_for``:
        a signal or a child), or on its timer (``due``)."""
        if waiting_for is not None:
            expect: dict[str, Any] = {"waiting_for": waiting_for}
        else:
            if run.status != RunStatus.SUSPENDED or run.wake_at is None or (due and run.wake_at > timezone.now()):
                return False
            expect = {"waiting_for": run.waiting_for, "wake_at": run.wake_at}
        return self.reenter(run, RunStatus.SUSPENDED, expect=expect, waiting_for="", wake_at=None)

    def reenter(self, run: RunRecord, from_status: str, *, expect: dict[str, Any] | None = None, **fields: Any) -> bool:
        """Move a ``suspended`` or ``blocked`` run back to work (compare-and-set).

        Where ``from_status`` held no slot of a key (it is not in the key's counted
        statuses) and that key is full now, the run is ``queued`` instead of
        ``pending``: it gets the key's next free slot, so coming back never takes a
        key over its limit. Its keys are handed on after commit, as a queued start's are.
        """
        engine = self.engine.in_namespace(run.namespace)
        settings_by_key = self.store.quota_settings(self.store.run_keys(run.run_id))
        recount = [
            Quota(key, limit, statuses)
            for key, (limit, statuses) in sorted(settings_by_key.items())
            if limit is not None and statuses and from_status not in statuses
        ]
        with self.store.admission(recount) as locked:
            recount = list(locked or recount)  # the limits in effect, read under the locks
            full = any(engine.count_runs(q.tag, q.count_statuses) >= q.limit for q in recount)
            to = RunStatus.QUEUED if full else RunStatus.PENDING
            moved = self.store.transition(
                run.run_id, from_statuses=[from_status], to=to, expect=expect, dispatched_at=timezone.now(), **fields
            )
        if moved and to == RunStatus.PENDING:
            self.engine.dispatch.send(self.engine, run)
        elif moved:
            # A slot may free between the count and the commit: hand it on, as a start does.
            keys = [q.key for q in recount]
            self.store.on_commit(lambda: engine.promoter.promote(keys))
        return moved

    def wake_due(self, run_id: str) -> bool:
        """The timer of a sleep or a signal timeout went off (a late or repeated timer does nothing)."""
        run = self.store.get_run(run_id)
        return run is not None and self.resume(run, due=True)

    # -- recovery ------------------------------------------------------------------------------
    def sweep(self) -> dict[str, list[str]]:
        now = timezone.now()
        # A run is re-sent REDISPATCH_AFTER * 2**n after its n-th re-send: a backlog
        # that workers are slow to take is not sent again on every sweep.
        cutoffs = redispatch_cutoffs(now, float(settings.REDISPATCH_AFTER))
        orphaned = self.store.orphaned_runs(now - timedelta(seconds=float(settings.STALE_AFTER)), cutoffs)
        undelivered = self.store.undelivered_runs(cutoffs)
        runs = orphaned + undelivered
        if runs:
            self.store.mark_dispatched([r.run_id for r in runs])
            for run in runs:
                self.engine.dispatch.send(self.engine, run)
            logger.warning("Sweep re-dispatched %d orphaned and %d undelivered runs.", len(orphaned), len(undelivered))
        woken = [r.run_id for r in self.store.due_runs(now) if self.resume(r, due=True)]
        # A child ended, but the wake-up of its parent was lost.
        woken += [r.run_id for r in self.store.waiting_parents() if self.resume(r, waiting_for=r.waiting_for)]
        promoted = [
            run_id
            for namespace, keys in self.store.keys_with_queued().items()
            for run_id in self.engine.in_namespace(namespace).promoter.promote(keys)
        ]
        if promoted:
            logger.warning("Sweep started %d queued runs whose keys had room.", len(promoted))
        handed = self.store.hand_off_slots()
        self.slots_handed(handed)
        blocked, unblocked = self.check_remote_queues()
        purged = self._apply_retention(now)
        return {
            "orphaned": [r.run_id for r in orphaned],
            "undelivered": [r.run_id for r in undelivered],
            "woken": woken,
            "promoted": promoted,
            "slots": [run_id for _, run_id in handed],
            "blocked": blocked,
            "unblocked": unblocked,
            "purged": purged,
        }

    def _apply_retention(self, now: datetime) -> list[str]:
        """Delete one bounded batch of finished runs past ``RETENTION`` (last, so a
        failure here never holds up recovery: it is logged, and the next sweep tries again)."""
        try:
            policy = retention.retention_policy()
            if not policy:
                return []
            purged = self.store.purge_finished(retention.expired(now, policy), limit=retention.SWEEP_BATCH_SIZE)
        except Exception:
            self._recover()
            logger.exception("Sweep could not delete the finished runs past DURABLE['RETENTION'].")
            return []
        if purged:
            logger.info("Sweep deleted %d finished runs past DURABLE['RETENTION'].", len(purged))
        return purged

    # -- remote workflows ------------------------------------------------------------------------
    def check_remote_queues(self, live_queues: Sequence[str] | None = None, *, block: bool = True) -> tuple[list[str], list[str]]:
        """Mark pending runs of queues no live worker consumes ``blocked`` (when
        ``block``); send blocked runs whose queue has a worker again. ``live_queues``
        defaults to asking the dispatcher's workers (only when there are such runs)."""
        runs = self.store.runs_on_queues([RunStatus.PENDING, RunStatus.BLOCKED])
        if not runs:
            return [], []
        if live_queues is None:
            live_queues = self.engine.dispatch.live_queues()
            if live_queues is None:  # a dispatcher without workers to ask (inline, tests)
                return [], []
        live = set(live_queues)
        blocked, unblocked = [], []
        for run in runs:
            if block and run.status == RunStatus.PENDING and run.queue not in live:
                if self.store.transition(run.run_id, from_statuses=[RunStatus.PENDING], to=RunStatus.BLOCKED):
                    blocked.append(run.run_id)
                    self.released(run)  # if "blocked" does not count for a key, its slot is free now
            elif run.status == RunStatus.BLOCKED and run.queue in live and self.reenter(run, RunStatus.BLOCKED):
                unblocked.append(run.run_id)
        if blocked:
            logger.warning("%d runs are blocked: no live worker consumes their queue.", len(blocked))
        return blocked, unblocked


def send_run_finished(engine: Engine, run: RunRecord, status: str, *, output: Any = None, error: Any = None) -> None:
    """Send ``run_finished`` for ``run``, which just reached terminal ``status``, on commit."""
    finished_at = timezone.now()
    started_at = run.started_at
    signals.send_on_commit(
        engine.store.on_commit,
        signals.run_finished,
        engine,
        run_id=run.run_id,
        workflow=run.workflow,
        version=run.version,
        namespace=run.namespace,
        status=status,
        output=output,
        error=error,
        started_at=started_at,
        finished_at=finished_at,
        duration=None if started_at is None else max(0.0, (finished_at - started_at).total_seconds()),
    )


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}"


class _Beat:
    """One execution in flight, as ``Heartbeats`` keeps it."""

    __slots__ = ("executor", "run_id", "lease", "lost", "due")

    def __init__(self, executor: Executor, run_id: str, lease: str, due: float) -> None:
        self.executor, self.run_id, self.lease, self.due = executor, run_id, lease, due
        self.lost = threading.Event()


class Heartbeats:
    """Beats the executions in flight in this process, from one daemon thread.

    Each execution is beaten every ``HEARTBEAT_INTERVAL`` from the moment it is added
    (its claim set the first ``heartbeat_at``), as a thread of its own would beat it,
    without a thread started and joined around every run (a fraction of a millisecond
    on the way to the first step's body and again after the last). A heartbeat that
    finds the run no longer its lease's sets the execution's ``lost`` event and stops
    beating it. A failed heartbeat (the database unreachable) is logged, the thread's
    connection is dropped if the error left it unusable, and the run is beaten again
    on the next pass: one blip must not let a run look orphaned. After each pass the
    thread closes its database connections (``BaseStore.release_thread``), so it holds
    none between beats. A forked child (a prefork worker process) starts a thread of
    its own on its first execution.
    """

    def __init__(self) -> None:
        self._after_fork()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[int, _Beat] = {}
        self._pid = 0
        self._wake = threading.Event()
        #: When the thread looks next (monotonic): an execution due sooner wakes it.
        self._next = 0.0

    @contextmanager
    def beating(self, executor: Executor, run_id: str, lease: str) -> Iterator[threading.Event]:
        beat = _Beat(executor, run_id, lease, time.monotonic() + float(settings.HEARTBEAT_INTERVAL))
        with self._lock:
            if self._pid != os.getpid():
                self._start()
            self._beats[id(beat)] = beat
            wake = beat.due < self._next
        if wake:
            self._wake.set()
        try:
            yield beat.lost
        finally:
            with self._lock:
                self._beats.pop(id(beat), None)

    def _start(self) -> None:
        """(Under the lock) the thread of this process."""
        threading.Thread(target=self._serve, name="durable-heartbeats", daemon=True).start()
        self._pid = os.getpid()

    def _serve(self) -> None:
        wake = self._wake
        while True:
            try:
                self._pass()
            except Exception:  # the thread must live on: the next pass beats the runs again
                logger.exception("The durable heartbeat thread failed a pass; it beats again at the next one.")
            with self._lock:
                pending = [beat.due for beat in self._beats.values()]
                # With none in flight, look again after an interval (a run added meanwhile is due later).
                self._next = min(pending, default=time.monotonic() + float(settings.HEARTBEAT_INTERVAL))
                wake.clear()
            wake.wait(max(self._next - time.monotonic(), 0.0))

    def _pass(self) -> None:
        """Beat every execution that is due; then close the connections the beats opened."""
        now = time.monotonic()
        with self._lock:
            due = [beat for beat in self._beats.values() if beat.due <= now]
        stores: dict[int, BaseStore] = {}
        try:
            for beat in due:
                beat.due = now + float(settings.HEARTBEAT_INTERVAL)
                store = beat.executor.store
                stores[id(store)] = store
                try:
                    owned = store.heartbeat(beat.run_id, beat.lease)
                except Exception as exc:  # never let a heartbeat failure end the heartbeats
                    logger.warning("Heartbeat of run %s failed, retrying: %s", beat.run_id, exc)
                    beat.executor._recover()
                    continue
                if not owned:
                    beat.lost.set()
                    with self._lock:
                        self._beats.pop(id(beat), None)
        finally:
            for store in stores.values():
                store.release_thread()


#: This process's heartbeats (a forked child starts its own thread).
heartbeats = Heartbeats()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=heartbeats._after_fork)
