"""The engine: starting runs under their quotas, executing them, reading them.

``Engine`` is made of its start path (``durable.runtime.starting.Starting``) and
what is here: declaring workflows, limits changed live, reads, cancels, retries,
signals, events, and what a worker calls. The handles it returns are in
``durable.runtime.handles`` (``RunHandle``, ``EmitResult``, importable from here too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from asgiref.sync import sync_to_async
from django.utils import timezone

from durable import concurrency as _concurrency
from durable import exceptions, signals
from durable.conf import settings
from durable.runtime import admission, bursts
from durable.runtime import dispatch as _dispatch
from durable.runtime import limits as _limits
from durable.runtime.execution import Executor, send_run_finished
from durable.runtime.handles import EmitResult, RunHandle, SkippedSubscriber
from durable.runtime.registry import Definition, Registry, WorkflowFn, default_registry
from durable.runtime.starting import Starting, per_start, valid_run_id
from durable.status import ACTIVE_STATUSES, RETRYABLE_STATUSES, TERMINAL_STATUSES, RunStatus
from durable.stores.base import BaseStore, RunRecord
from durable.util import check_json

__all__ = ["EmitResult", "Engine", "RunHandle", "SkippedSubscriber"]

logger = logging.getLogger(__name__)


class Engine(Starting):
    """Starts, executes and reads runs.

    ``store`` defaults to ``DjangoStore()``; ``dispatch`` (a ``Dispatcher``, or a
    plain function ``fn(engine, run)`` that only sends) to the default dispatcher,
    Celery's (``durable.runtime.dispatch.inline_dispatch`` runs in the caller's
    thread). ``namespace`` and ``scope_reads`` default to the ``NAMESPACE`` and
    ``SCOPE_READS`` settings.
    """

    def __init__(
        self,
        store: BaseStore | None = None,
        *,
        namespace: str | None = None,
        scope_reads: bool | None = None,
        dispatch: _dispatch.DispatcherLike | None = None,
        registry: Registry | None = None,
    ) -> None:
        self._store = store
        self._namespace = namespace
        self._scope_reads = scope_reads
        self.dispatch = _dispatch.as_dispatcher(dispatch)
        self.registry = registry or default_registry
        self.executor = Executor(self)

    @property
    def store(self) -> BaseStore:
        if self._store is None:
            from durable.stores.database import DjangoStore

            self._store = DjangoStore()
        return self._store

    @property
    def admission_scope(self) -> admission.Scope:
        """What admission works on: this engine's store, the namespace its quotas
        count in (``read_namespace``), and its dispatcher's ``send``."""
        return admission.Scope(self.store, self.read_namespace, lambda run: self.dispatch.send(self, run))

    @property
    def promoter(self) -> admission.Promoter:
        """Hands the free slots of keys to their queued runs, counted as this engine counts."""
        return admission.Promoter(self.admission_scope)

    @property
    def namespace(self) -> str:
        return self._namespace if self._namespace is not None else settings.NAMESPACE

    @property
    def scope_reads(self) -> bool:
        return self._scope_reads if self._scope_reads is not None else bool(settings.SCOPE_READS)

    @property
    def read_namespace(self) -> str | None:
        """The namespace reads and quota counts are fenced to, or None (every namespace)."""
        return self.namespace if self.scope_reads else None

    def in_namespace(self, namespace: str, *, scope_reads: bool | None = None) -> Engine:
        """This engine for another namespace (same store, dispatcher and registry;
        the same fencing unless ``scope_reads`` is given)."""
        fencing = self._scope_reads if scope_reads is None else scope_reads
        if namespace == self.namespace and fencing == self._scope_reads:
            return self
        return Engine(self._store, namespace=namespace, scope_reads=fencing, dispatch=self.dispatch, registry=self.registry)

    # -- declaring -------------------------------------------------------------
    def register(
        self,
        name: str,
        version: str,
        fn: WorkflowFn,
        concurrency: _concurrency.ConcurrencySpec = None,
        *,
        on_events: Sequence[str] = (),
    ) -> Definition:
        """Register ``fn(ctx, input)`` as workflow ``name`` at ``version``.

        The version registered last is the one new runs start on; runs in flight
        finish on the version they started on. ``on_events`` lists the event names
        that start it (``emit``).
        """
        return self.registry.register(name, version, fn, concurrency, on_events=on_events)

    def register_remote(
        self,
        name: str,
        version: str,
        *,
        queue: str,
        concurrency: _concurrency.ConcurrencySpec = None,
    ) -> Definition:
        """Declare a workflow whose body runs in another service, on the Celery
        workers that consume ``queue`` (where it is registered with its body).

        Starting it here applies its quota; while no live worker consumes the
        queue its runs are ``blocked`` (and hold their slots by default).
        """
        if not isinstance(queue, str) or not queue:
            raise ValueError(f"register_remote() needs the queue its workers consume, got {queue!r}.")
        return self.registry.register(name, version, None, concurrency, queue=queue)

    # -- limits ----------------------------------------------------------------
    def set_limit_override(self, key: str, limit: int | None, reason: str, *, user: Any = None) -> _limits.LimitChangeRecord:
        """Replace the limit of concurrency ``key`` by ``limit`` (None: clear the
        override, the code's limit applies again), recording who (``user``), when,
        the old and new values and ``reason``.

        The next admission of the key applies it: each reads the override under the
        key's lock. Lowering a limit below the runs in flight cancels nothing; it
        refuses (or queues) new starts until they drop below it. Raising it hands
        the new room to the key's queued runs and to the steps waiting for a slot
        of the key (step-level quotas).
        """
        key, limit, reason = _limits.check_override(key, limit, reason)
        change = self.store.set_limit_override(
            key, limit, reason=reason, changed_by=user, changed_by_name=_limits.user_name(user)
        )
        logger.info("Limit of concurrency key %s: %s -> %s (%s)", key, change.old_limit, change.new_limit, reason)
        self.store.on_commit(lambda: self.promoter.promote([key]))
        self.store.on_commit(lambda: self._hand_off_step_slots(key))
        return change

    def _hand_off_step_slots(self, key: str) -> None:
        """Hand the key's free step slots to its waiting steps (a fast path: the sweeper does it too)."""
        try:
            self.executor.slots_handed(self.store.hand_off_key_slots([key]))
        except Exception:
            self.store.recover()
            logger.warning("The step slots of %s were not handed on after its new limit; the sweeper does.", key, exc_info=True)

    # -- reading ---------------------------------------------------------------
    def _load(self, run_id: str) -> RunRecord:
        record = self.store.get_run(run_id) if valid_run_id(run_id) else None
        if record is None or (self.scope_reads and record.namespace != self.namespace):
            raise exceptions.RunNotFound(f"No run has the id {run_id!r}.", run_id=run_id)
        return record

    def get_run(self, run_id: str) -> RunHandle:
        return RunHandle(self, self._load(run_id))

    async def aget_run(self, run_id: str) -> RunHandle:
        return await sync_to_async(self.get_run)(run_id)

    def list_runs(
        self,
        workflow: str | None = None,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
    ) -> list[RunHandle]:
        records = self.store.list_runs(workflow=workflow, tag=tag, statuses=statuses, namespace=self.read_namespace)
        return [RunHandle(self, r) for r in records]

    async def alist_runs(
        self,
        workflow: str | None = None,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
    ) -> list[RunHandle]:
        return await sync_to_async(self.list_runs)(workflow, tag, statuses)

    def count_runs(self, tag: str | None = None, statuses: Sequence[str] | None = None) -> int:
        """One COUNT(*) through the store's ``count_runs`` (a store that does not
        override ``BaseStore.count_runs`` counts ``len(list_runs(...))``). This is
        what quotas count with."""
        return int(self.store.count_runs(tag=tag, statuses=statuses, namespace=self.read_namespace))

    # -- changing --------------------------------------------------------------
    def cancel(self, run_id: str) -> RunHandle:
        """Cancel a run now: it frees its slot at once and stops at its next step boundary."""
        record = self._load(run_id)
        if not self._cancel(record, reason="Cancelled."):
            record = self._load(run_id)
            raise exceptions.RunTerminalError(
                f"Run {run_id!r} is already {record.status}; only unfinished runs can be cancelled.",
                run_id=run_id,
                status=record.status,
            )
        return self.get_run(run_id)

    async def acancel(self, run_id: str) -> RunHandle:
        return await sync_to_async(self.cancel)(run_id)

    def _cancel(
        self,
        run: RunRecord,
        *,
        reason: str = "",
        error: dict[str, Any] | None = None,
        held_slots: bool = True,
    ) -> bool:
        """Cancel one run, revoke its pending messages, cancel its children.

        Its ``error`` is ``error``, by default ``{"type": "durable.cancelled",
        "message": reason}``; ``held_slots=False``: it was ``queued`` (it frees no
        slot to hand on)."""
        error = error or {"type": "durable.cancelled", "message": reason}
        cancelled = self.store.transition(
            run.run_id,
            from_statuses=ACTIVE_STATUSES,
            to=RunStatus.CANCELLED,
            lease="",
            waiting_for="",
            wake_at=None,
            error=error,
            finished_at=timezone.now(),
        )
        if cancelled:
            self._cancelled(run, error, held_slots=held_slots)
        return cancelled

    def _cancelled(self, run: RunRecord, error: dict[str, Any], *, held_slots: bool = True) -> None:
        """What follows the cancel of ``run`` (made by ``_cancel``, or by a store's
        ``admit_queued``): revoke its messages, cancel its children, free its slots
        (``held_slots=False``: a queued run held none, there is nothing to hand on)."""
        try:
            self.dispatch.revoke(self, run)
        except Exception:  # best effort: the run is cancelled, a late message does nothing
            logger.exception("Could not revoke the messages of cancelled run %s; the cancel goes on.", run.run_id)
        for child in self.store.active_children(run.run_id):
            self._cancel(child, reason=f"Cancelled with its parent run {run.run_id!r}.")
        self.executor.ended(run, hand_off=held_slots)
        if signals.run_finished.has_listeners(self):
            send_run_finished(self, run, RunStatus.CANCELLED, error=error)

    def retry(self, run_id: str, concurrency: _concurrency.ConcurrencySpec = None) -> RunHandle:
        """Start a failed, dead or cancelled run again, under its workflow's quota
        (or ``concurrency``), as a new start would be: its tags are replaced by the
        quotas checked now. The journal is kept but for the failure that ended a
        failed run (its last entry, when a failed step), which runs again;
        failures the workflow caught earlier replay as they did."""
        record = self._load(run_id)
        if record.status not in RETRYABLE_STATUSES:
            raise exceptions.RunTerminalError(
                f"Run {run_id!r} is {record.status}; only failed, dead or cancelled runs can be retried.",
                run_id=run_id,
                status=record.status,
            )
        definition = self.registry.get(record.workflow, record.version)
        specs = definition.concurrency if concurrency is None else per_start(concurrency)
        quotas = _concurrency.resolve(specs, record.input)
        try:
            with self.store.admission(bursts.with_pools(quotas)) as locked:
                quotas = bursts.in_effect(quotas, locked)
                # A retry never queues nor cancels: a full key refuses it, whatever its strategy.
                decision = admission.decide(
                    self.admission_scope, record.workflow, [replace(q, strategy=_concurrency.Strategy.REJECT) for q in quotas]
                )
                tags = list(dict.fromkeys([q.tag for q in quotas] + decision.borrowed))
                if not self.store.retry(run_id, from_statuses=sorted(RETRYABLE_STATUSES), tags=tags):
                    current = self._load(run_id).status
                    raise exceptions.RunTerminalError(
                        f"Run {run_id!r} is {current}; only failed, dead or cancelled runs can be retried.",
                        run_id=run_id,
                        status=current,
                    )
        except exceptions.ConcurrencyLimitError as exc:
            self._refused(exc, run_id)
            raise
        handle = self.get_run(run_id)
        self.dispatch.send(self, handle.record)
        return handle

    # -- signals and events --------------------------------------------------------
    def signal(self, run_id: str, name: str, payload: Any = None) -> RunHandle:
        """Send signal ``name`` to a run. A run waiting for it resumes; otherwise the
        signal is buffered until the run waits for it. ``RunTerminalError`` if the run has finished."""
        if not isinstance(name, str) or not name or len(name) > 255 or "\x00" in name:
            raise exceptions.InvalidStartError(f"A signal name must be a string of 1 to 255 characters, got {name!r}.")
        payload = check_json(payload, what="the signal payload")
        self._load(run_id)  # RunNotFound, also for another namespace's run
        run = self.store.add_signal(run_id, name, payload)
        assert run is not None
        if run.status in TERMINAL_STATUSES:
            raise exceptions.RunTerminalError(
                f"Run {run_id!r} is already {run.status}; it cannot receive signals.", run_id=run_id, status=run.status
            )
        self.executor.resume(run, waiting_for=f"signal:{name}")  # if it waits for this signal
        return self.get_run(run_id)

    async def asignal(self, run_id: str, name: str, payload: Any = None) -> RunHandle:
        return await sync_to_async(self.signal)(run_id, name, payload)

    def emit(self, name: str, payload: Any = None, event_id: str | None = None) -> EmitResult:
        """Start every workflow subscribed to event ``name`` with ``payload`` as input.

        A subscriber refused by its quota (or by bad input) is skipped and listed
        in the result; the others still start. With ``event_id``, each subscriber's
        run id is ``event:<event_id>:<workflow>``, so the same event never starts a
        subscriber twice.
        """
        result = EmitResult.of(name, event_id)
        for definition in self.registry.subscribers(name):
            try:
                handle = self.start(definition.name, payload, run_id=result.run_id(definition.name))
            except exceptions.DurableError as exc:
                result.skip(definition.name, exc)
            else:
                result.add(handle)
        return result

    async def aemit(self, name: str, payload: Any = None, event_id: str | None = None) -> EmitResult:
        """``emit`` for async code: each subscriber is started with ``astart``."""
        result = EmitResult.of(name, event_id)
        for definition in self.registry.subscribers(name):
            try:
                handle = await self.astart(definition.name, payload, run_id=result.run_id(definition.name))
            except exceptions.DurableError as exc:
                result.skip(definition.name, exc)
            else:
                result.add(handle)
        return result

    # -- executing -------------------------------------------------------------------
    def execute(self, run_id: str) -> None:
        """Execute (or resume) a run: what a Celery worker calls with a run id.

        A delivery that finds the run owned by a live execution, or finished,
        changes nothing.
        """
        self.executor.execute(run_id)

    def ensure_running(self, run_id: str, lease: str) -> None:
        self.executor.ensure_running(run_id, lease)

    def sweep(self) -> dict[str, list[str]]:
        """The periodic backstop: re-send orphaned runs (dead worker) and undelivered
        ones (lost message), wake due sleepers, start queued runs whose keys have
        room, block or unblock runs of remote queues, and delete a bounded batch of
        finished runs past ``DURABLE["RETENTION"]``."""
        return self.executor.sweep()
