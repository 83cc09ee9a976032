"""The engine: starting runs under their quotas, executing them, reading them."""

from __future__ import annotations

import asyncio
import logging
import time
import unicodedata
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
from durable.runtime.registry import Definition, Registry, WorkflowFn, default_registry
from durable.status import ACTIVE_STATUSES, RETRYABLE_STATUSES, TERMINAL_STATUSES, RunStatus
from durable.stores.base import BaseStore, RunExists, RunRecord, group_keys
from durable.util import check_json

logger = logging.getLogger(__name__)


class RunHandle:
    """A reference to one run. ``status`` is as of the last read; ``refresh()`` reads again."""

    def __init__(self, engine: Engine, record: RunRecord, *, created: bool = False) -> None:
        self._engine = engine
        self._record = record
        #: True when the call that returned this handle created the run (False for an
        #: idempotent re-start of an existing run id, or a read).
        self.created = created

    def __repr__(self) -> str:
        return f"<RunHandle {self.workflow} {self.run_id} {self.status}>"

    run_id = property(lambda self: self._record.run_id)
    workflow = property(lambda self: self._record.workflow)
    version = property(lambda self: self._record.version)
    namespace = property(lambda self: self._record.namespace)
    status = property(lambda self: self._record.status)
    input = property(lambda self: self._record.input)
    output = property(lambda self: self._record.output)
    error = property(lambda self: self._record.error)
    record = property(lambda self: self._record)

    def refresh(self) -> RunHandle:
        self._record = self._engine._load(self.run_id)
        return self

    async def arefresh(self) -> RunHandle:
        self._record = await sync_to_async(self._engine._load)(self.run_id)
        return self

    def result(self, timeout: float | None = None) -> Any:
        """Wait for a terminal status; return the output or raise ``RunFailedError``."""
        polls = _Polls(self, timeout)
        while self.refresh().status not in TERMINAL_STATUSES:
            time.sleep(polls.next_wait())
        return self._outcome()

    async def aresult(self, timeout: float | None = None) -> Any:
        """``result`` for async code: it polls without blocking the event loop."""
        polls = _Polls(self, timeout)
        while (await self.arefresh()).status not in TERMINAL_STATUSES:
            await asyncio.sleep(polls.next_wait())
        return self._outcome()

    def _outcome(self) -> Any:
        """The output of a finished run, or ``RunFailedError``."""
        if self.status == RunStatus.COMPLETED:
            return self.output
        message = (self.error or {}).get("message", "") if isinstance(self.error, dict) else ""
        raise exceptions.RunFailedError(
            f"Run {self.run_id!r} ended {self.status}" + (f": {message}" if message else "."),
            run_id=self.run_id,
            status=self.status,
            error=self.error,
        )

    def cancel(self) -> RunHandle:
        self._record = self._engine.cancel(self.run_id)._record
        return self

    def signal(self, name: str, payload: Any = None) -> RunHandle:
        self._record = self._engine.signal(self.run_id, name, payload)._record
        return self


class _Polls:
    """The waits between two reads of a run that ``result`` waits for: from 10 ms,
    doubling up to 250 ms, never past the deadline (``TimeoutError`` once it passed)."""

    def __init__(self, handle: RunHandle, timeout: float | None) -> None:
        self.handle, self.timeout = handle, timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.delay = 0.01

    def next_wait(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, 0.25)
        if self.deadline is None:
            return delay
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"Run {self.handle.run_id!r} is still {self.handle.status} after {self.timeout}s.")
        return min(delay, left)


class Engine:
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

    # -- starting --------------------------------------------------------------
    def start(
        self,
        name: str,
        input: Any = None,
        run_id: str | None = None,
        concurrency: _concurrency.ConcurrencySpec = None,
        *,
        version: str | None = None,
        parent_run_id: str | None = None,
        queue: str | None = None,
    ) -> RunHandle:
        """Create a run of workflow ``name`` under its quota and hand it to a worker.

        Raises ``ConcurrencyLimitError`` (creating nothing) when a quota is full,
        ``InvalidStartError`` for bad input, ``UnknownWorkflowError``. ``version``
        picks a registered version (default: the one registered last).

        A ``run_id`` that names a run returns it (never refused, even while that
        run's own start is not committed yet). A child start (``parent_run_id``)
        counts in its parent's namespace with its parent's fencing and never
        cancels or queues behind its ancestors (see ``admission.decide``).

        ``queue``: the Celery queue of this run's messages instead of the workflow's
        (a workflow registered with ``register_remote`` keeps its own). A run on a
        queue no live worker consumes is ``blocked``, as a remote workflow's run is.
        """
        return self._start(name, input, run_id, concurrency, version=version, parent_run_id=parent_run_id, queue=queue)

    async def astart(
        self,
        name: str,
        input: Any = None,
        run_id: str | None = None,
        concurrency: _concurrency.ConcurrencySpec = None,
        *,
        version: str | None = None,
        parent_run_id: str | None = None,
        queue: str | None = None,
    ) -> RunHandle:
        """``start`` for async code (an async view under ASGI), with every guarantee
        of ``start``: exact admission, ``ConcurrencyLimitError`` when a quota is full.

        An async limit function is awaited here, on the running event loop; the
        admission itself (the database) runs in a thread, as Django runs sync code
        for async callers (``sync_to_async``).
        """
        definition = self.registry.current(name) if version is None else self.registry.get(name, str(version))
        specs = definition.concurrency if concurrency is None else _per_start(concurrency)
        limits = await _concurrency.aresolve_limits(specs, input)
        start = sync_to_async(self._start)
        return await start(
            name,
            input,
            run_id,
            concurrency,
            version=definition.version,
            parent_run_id=parent_run_id,
            limits=limits,
            queue=queue,
        )

    def _start(
        self,
        name: str,
        input: Any,
        run_id: str | None,
        concurrency: _concurrency.ConcurrencySpec,
        *,
        version: str | None,
        parent_run_id: str | None,
        limits: _concurrency.Limits | None = None,
        queue: str | None = None,
    ) -> RunHandle:
        definition = self.registry.current(name) if version is None else self.registry.get(name, str(version))
        input = check_json(input, what="the workflow input")
        queue = _run_queue(definition, queue)
        if run_id is not None:
            # An existing run is returned first: one created before the run id rule stays re-startable.
            existing = self.store.get_run(run_id) if _valid_run_id(run_id) else None
            if existing is not None:
                return self._restarted(existing, definition.name)
            _check_run_id(run_id)
        ancestors = self._ancestors(parent_run_id)
        if ancestors and (ancestors[0].namespace, ancestors[0].fenced) != (self.namespace, self.scope_reads):
            # A child counts in its parent's namespace with its parent's fencing,
            # whatever the fencing of the engine that executes the parent.
            engine = self.in_namespace(ancestors[0].namespace, scope_reads=ancestors[0].fenced)
            return engine._start(
                name,
                input,
                run_id,
                concurrency,
                version=definition.version,
                parent_run_id=parent_run_id,
                limits=limits,
                queue=queue,
            )
        specs = definition.concurrency if concurrency is None else _per_start(concurrency)
        quotas = _concurrency.resolve(specs, input, limits=limits)
        record = RunRecord(
            run_id=run_id or uuid.uuid4().hex,
            workflow=definition.name,
            version=definition.version,
            namespace=self.namespace,
            status=RunStatus.PENDING,
            input=input,
            parent_run_id=parent_run_id,
            queue=queue,
            fenced=self.scope_reads,
        )
        tags = [q.tag for q in quotas]
        given = run_id is not None
        strategies = {q.strategy for q in quotas}
        superseded: list[RunRecord] = []
        try:
            if strategies <= {_concurrency.Strategy.REJECT}:
                admitted = self.store.admit(record, quotas, count_namespace=self.read_namespace, run_id_given=given)
            elif strategies <= _ONE_CALL_STRATEGIES:
                admitted = self.store.admit_queued(
                    record,
                    quotas,
                    count_namespace=self.read_namespace,
                    run_id_given=given,
                    ancestors=ancestors,
                    superseded=superseded,
                )
            else:
                admitted = False
            if not admitted:
                self._admit(definition.name, record, quotas, run_id_given=given, ancestors=ancestors)
        except RunExists:
            # Another starter created the same explicit run id first.
            existing = self.store.get_run(record.run_id)
            assert existing is not None
            return self._restarted(existing, definition.name)
        except exceptions.ConcurrencyLimitError as exc:
            self._refused(exc, record.run_id if given else None)
            raise
        for run in superseded:  # queued runs the store's admit_queued cancelled for this start
            self._cancelled(run, run.error or {}, held_slots=False)
        if signals._run_created.has_listeners(self) or signals.run_finished.has_listeners(self):
            self._created(record)
        if record.status == RunStatus.PENDING:
            self.dispatch.send(self, record)
        elif record.status == RunStatus.QUEUED:
            # A slot may have freed between the count and now: hand it on.
            self.store.on_commit(lambda: self.promoter.promote([q.key for q in quotas]))
        record.tags = record.tags or tags  # the admission's, when the run borrowed from a pool
        return RunHandle(self, record, created=True)

    def _admit(
        self,
        workflow: str,
        record: RunRecord,
        quotas: Sequence[_concurrency.Quota],
        *,
        run_id_given: bool = False,
        ancestors: Sequence[RunRecord] = (),
    ) -> None:
        """The generic admission, through the store's ``admission``/``count_runs``:
        lock the keys, count, apply the strategies, create the run.

        A refusal of a run id the caller chose first checks, under the locks,
        whether a run has that id (a start of it may have committed while this
        one waited): an idempotent re-start is never refused (``RunExists``).
        """
        # A burst's pool is locked with the keys, in key order (bursts.with_pools).
        with self.store.admission(bursts.with_pools(quotas)) as locked:
            quotas = bursts.in_effect(quotas, locked)  # the limits in effect (an operator's override), read under the locks
            try:
                decision = admission.decide(self.admission_scope, workflow, quotas, ancestors=ancestors)
            except exceptions.ConcurrencyLimitError:
                if run_id_given and self.store.run_exists(record.run_id):
                    raise RunExists(record.run_id) from None
                raise
            record.status = decision.status
            if decision.status == RunStatus.CANCELLED:
                record.error = {"type": decision.cancel_type, "message": decision.reason, **decision.details}
                record.finished_at = timezone.now()
            record.tags = list(dict.fromkeys([q.tag for q in quotas] + decision.borrowed))
            self.store.create_run(record, record.tags)  # first: a taken run id cancels nothing
            for gone in decision.superseded:
                # Cancelled under the key's lock: the queue never holds more than max_queued.
                # One cancelled meanwhile (by a user) left the queue already.
                self._cancel(gone.run, error=_concurrency.replaced_error(gone.key, record.run_id), held_slots=False)
            reason = f"Cancelled to make room for run {record.run_id!r} (CANCEL_IN_PROGRESS)."
            if not all([self._cancel(victim, reason=reason) for victim in decision.victims]):
                # A victim ended meanwhile (it can no longer be cancelled): the start
                # stands only if no key is over its limit now; else it is refused
                # and the transaction rolls back (the cancels too).
                admission.check_room(self.admission_scope, workflow, quotas, record.status)
            if record.status == RunStatus.PENDING:
                # Direct admission moves the round-robin cursor as a hand-off does.
                groups = group_keys([q.tag for q in quotas])
                for quota in quotas:
                    if quota.strategy is _concurrency.Strategy.GROUP_ROUND_ROBIN:
                        self.store.set_rr_cursor(quota.key, groups[quota.tag])

    def _refused(self, exc: exceptions.ConcurrencyLimitError, run_id: str | None) -> None:
        """Send ``start_refused`` at once: a refused start wrote nothing, there is no commit to wait for."""
        if not signals.start_refused.has_listeners(self):
            return
        signals.send(
            signals.start_refused,
            self,
            workflow=exc.workflow,
            key=exc.key,
            limit=exc.limit,
            active=exc.active,
            namespace=self.namespace,
            run_id=run_id,
            error=exc,
        )

    def _created(self, record: RunRecord) -> None:
        """A start created ``record``: the internal ``_run_created``, and ``run_finished``
        for a run created ``cancelled`` (CANCEL_NEWEST), on commit."""
        if signals._run_created.has_listeners(self):
            signals.send_on_commit(
                self.store.on_commit,
                signals._run_created,
                self,
                run_id=record.run_id,
                workflow=record.workflow,
                namespace=record.namespace,
                status=record.status,
            )
        if record.status == RunStatus.CANCELLED and signals.run_finished.has_listeners(self):
            send_run_finished(self, record, RunStatus.CANCELLED, error=record.error)

    def would_admit(
        self,
        name: str,
        input: Any = None,
        concurrency: _concurrency.ConcurrencySpec = None,
        *,
        version: str | None = None,
        run_id: str | None = None,
    ) -> _limits.AdmissionCheck:
        """Whether ``start(name, input, run_id, concurrency)`` would be admitted now,
        creating nothing and locking nothing: an ``AdmissionCheck`` with ``admitted``,
        the ``outcome`` the key's strategy gives, and each key's limit in effect and
        in-flight count. Raises as ``start`` does for bad input or an unknown workflow.
        """
        definition = self.registry.current(name) if version is None else self.registry.get(name, str(version))
        input = check_json(input, what="the workflow input")
        if run_id is not None:
            existing = self.store.get_run(run_id) if _valid_run_id(run_id) else None
            if existing is not None:
                self._restarted(existing, definition.name)  # RunIdTaken for another workflow's run
                return _limits.existing(definition.name, run_id)
            _check_run_id(run_id)
        specs = definition.concurrency if concurrency is None else _per_start(concurrency)
        return _limits.check(self.admission_scope, definition.name, _concurrency.resolve(specs, input))

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

    def _ancestors(self, parent_run_id: str | None) -> list[RunRecord]:
        """The parent of a child start, its parent, and so on up to the root."""
        chain: list[RunRecord] = []
        while parent_run_id is not None and len(chain) < _MAX_DEPTH:
            parent = self.store.get_run(parent_run_id)
            if parent is None:
                break
            chain.append(parent)
            parent_run_id = parent.parent_run_id
        return chain

    def _restarted(self, existing: RunRecord, workflow: str) -> RunHandle:
        """An idempotent re-start returns the existing run, if it is this start's run."""
        if existing.workflow != workflow or existing.namespace != self.namespace:
            # Another workflow's or another namespace's run: never hand it out.
            raise exceptions.RunIdTaken(
                f"The run id {existing.run_id!r} is already used by another run; choose another run id.",
                run_id=existing.run_id,
            )
        return RunHandle(self, existing)

    # -- reading ---------------------------------------------------------------
    def _load(self, run_id: str) -> RunRecord:
        record = self.store.get_run(run_id) if _valid_run_id(run_id) else None
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
        specs = definition.concurrency if concurrency is None else _per_start(concurrency)
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


@dataclass
class SkippedSubscriber:
    workflow: str
    error: Exception


@dataclass
class EmitResult:
    """What ``engine.emit`` did: runs started, runs that existed already for this
    event id (not started twice), and subscribers skipped with the reason."""

    event: str
    event_id: str | None
    started: list[RunHandle] = field(default_factory=list)
    duplicates: list[RunHandle] = field(default_factory=list)
    skipped: list[SkippedSubscriber] = field(default_factory=list)

    @classmethod
    def of(cls, event: Any, event_id: Any) -> EmitResult:
        """An empty result, once the event's name and id are checked."""
        if not isinstance(event, str) or not event:
            raise exceptions.InvalidStartError(f"An event name must be a non-empty string, got {event!r}.")
        if event_id is not None and (not isinstance(event_id, str) or not event_id):
            raise exceptions.InvalidStartError(f"An event id must be a non-empty string, got {event_id!r}.")
        return cls(event=event, event_id=event_id)

    def run_id(self, workflow: str) -> str | None:
        """The run id of subscriber ``workflow``: one per event id, None without one."""
        return None if self.event_id is None else f"event:{self.event_id}:{workflow}"

    def add(self, handle: RunHandle) -> None:
        (self.started if handle.created else self.duplicates).append(handle)

    def skip(self, workflow: str, exc: exceptions.DurableError) -> None:
        logger.warning("Event %s (%s) skipped subscriber %s: %s", self.event, self.event_id, workflow, exc)
        self.skipped.append(SkippedSubscriber(workflow, exc))


#: The strategies a store's ``admit_queued`` decides alone (CANCEL_IN_PROGRESS and
#: CANCEL_NEWEST take the generic path).
_ONE_CALL_STRATEGIES = frozenset({_concurrency.Strategy.REJECT, *_concurrency.QUEUEING_STRATEGIES})

#: How many ancestors a child start looks at (a backstop against a cycle of parents).
_MAX_DEPTH = 1000


def _per_start(spec: _concurrency.ConcurrencySpec) -> tuple[_concurrency.Concurrency, ...]:
    specs = _concurrency.normalize(spec)
    for c in specs:
        if not c.is_static:
            raise exceptions.InvalidStartError(
                "A per-start Concurrency takes a plain string key and an integer limit (not a function or a CEL "
                "expression: compute them from the input before the start)."
            )
    return specs


def _run_queue(definition: Definition, queue: str | None) -> str:
    """The Celery queue of a new run: ``queue`` if given (not for a remote workflow,
    whose body only its own queue's workers have), else the workflow's."""
    if queue is None or definition.fn is None:
        return definition.queue
    if not isinstance(queue, str) or len(queue) > 200 or "\x00" in queue:
        raise exceptions.InvalidStartError(f"A queue name must be a string of at most 200 characters, got {queue!r}.")
    return queue


#: Longest run id (the size of its column).
MAX_RUN_ID_LENGTH = 255


def _valid_run_id(run_id: Any) -> bool:
    """Whether ``run_id`` can name a stored run (a lookup; runs created before the
    rule of ``_check_run_id`` may hold ``/``)."""
    return (
        isinstance(run_id, str)
        and 0 < len(run_id) <= MAX_RUN_ID_LENGTH
        and "\x00" not in run_id
        and not any("\ud800" <= c <= "\udfff" for c in run_id)  # a lone surrogate cannot be stored
    )


def _check_run_id(run_id: Any) -> None:
    """The rule for a new run's explicit id: one the HTTP API's URLs can address.

    ``runs/<run_id>/`` and its ``cancel/`` and ``signal/`` sub-resources take the
    id as one path segment, so it may not hold ``/``, control characters (a URL
    cannot carry a newline), lone surrogates, leading or trailing whitespace, nor
    be ``.`` or ``..`` (clients resolve them as relative path segments).
    """
    if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID_LENGTH:
        raise exceptions.InvalidStartError(f"A run id must be a string of 1 to {MAX_RUN_ID_LENGTH} characters, got {run_id!r}.")
    problem = ""
    if "/" in run_id:
        problem = "contains '/'"
    elif any(unicodedata.category(c) in ("Cc", "Cs") for c in run_id):
        problem = "contains a control character or a lone surrogate"
    elif run_id != run_id.strip():
        problem = "starts or ends with whitespace"
    elif run_id in (".", ".."):
        problem = "is a relative path segment"
    if problem:
        raise exceptions.InvalidStartError(
            f"A run id {problem}, got {run_id!r}: a run id is one segment of the HTTP API's URLs "
            "(runs/<run_id>/), so it may not contain '/' or control characters, start or end with "
            "whitespace, or be '.' or '..'."
        )
