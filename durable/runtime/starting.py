"""Starting runs: ``Engine.start`` and ``astart``, the admission of a start under its
quotas (a store's one-call ``admit``/``admit_queued``, else the generic path),
``would_admit``, and the rules for a run's explicit id.

``Starting`` is a part of ``Engine`` (its base class), as ``DjangoStore`` is made of
its ``Admission`` and ``Lifecycle``: every method here is the engine's.
"""

from __future__ import annotations

import unicodedata
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from asgiref.sync import sync_to_async
from django.utils import timezone

from durable import concurrency as _concurrency
from durable import exceptions, signals
from durable.runtime import admission, bursts
from durable.runtime import limits as _limits
from durable.runtime.execution import send_run_finished
from durable.runtime.handles import RunHandle
from durable.runtime.registry import Definition
from durable.status import RunStatus
from durable.stores.base import Promotion, RunExists, RunRecord, group_keys
from durable.util import check_json

if TYPE_CHECKING:
    from durable.runtime import dispatch as _dispatch
    from durable.runtime.engine import Engine
    from durable.runtime.registry import Registry
    from durable.stores.base import BaseStore


class Starting:
    """``Engine``'s start path, from the call to the run handed to a worker."""

    # What the start path uses of the rest of Engine, for the type checker (which
    # also needs ``cast("Engine", self)`` where the engine itself is handed on).
    if TYPE_CHECKING:
        registry: Registry
        dispatch: _dispatch.Dispatcher

        @property
        def store(self) -> BaseStore: ...
        @property
        def namespace(self) -> str: ...
        @property
        def scope_reads(self) -> bool: ...
        @property
        def read_namespace(self) -> str | None: ...
        @property
        def admission_scope(self) -> admission.Scope: ...
        @property
        def promoter(self) -> admission.Promoter: ...
        def in_namespace(self, namespace: str, *, scope_reads: bool | None = None) -> Engine: ...
        def _cancel(
            self, run: RunRecord, *, reason: str = "", error: dict[str, Any] | None = None, held_slots: bool = True
        ) -> bool: ...
        def _cancelled(self, run: RunRecord, error: dict[str, Any], *, held_slots: bool = True) -> None: ...

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
        specs = definition.concurrency if concurrency is None else per_start(concurrency)
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
            existing = self.store.get_run(run_id) if valid_run_id(run_id) else None
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
        specs = definition.concurrency if concurrency is None else per_start(concurrency)
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
        promotion: Promotion | None = None  # the promote the store made after a queued start's commit
        try:
            if strategies <= {_concurrency.Strategy.REJECT}:
                admitted = self.store.admit(record, quotas, count_namespace=self.read_namespace, run_id_given=given)
            elif strategies <= _ONE_CALL_STRATEGIES:
                promotion = Promotion([q.key for q in quotas], self.read_namespace)
                admitted = self.store.admit_queued(
                    record,
                    quotas,
                    count_namespace=self.read_namespace,
                    run_id_given=given,
                    ancestors=ancestors,
                    superseded=superseded,
                    promotion=promotion,
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
            self.dispatch.send(cast("Engine", self), record)
        if promotion is not None and promotion.started:
            self.promoter.send(promotion.started)
        if record.status == RunStatus.QUEUED and (promotion is None or not promotion.done):
            # A slot may have freed between the count and now: hand it on.
            self.store.on_commit(lambda: self.promoter.promote([q.key for q in quotas]))
        record.tags = record.tags or tags  # the admission's, when the run borrowed from a pool
        return RunHandle(cast("Engine", self), record, created=True)

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
            send_run_finished(cast("Engine", self), record, RunStatus.CANCELLED, error=record.error)

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
            existing = self.store.get_run(run_id) if valid_run_id(run_id) else None
            if existing is not None:
                self._restarted(existing, definition.name)  # RunIdTaken for another workflow's run
                return _limits.existing(definition.name, run_id)
            _check_run_id(run_id)
        specs = definition.concurrency if concurrency is None else per_start(concurrency)
        return _limits.check(self.admission_scope, definition.name, _concurrency.resolve(specs, input))

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
        return RunHandle(cast("Engine", self), existing)


#: The strategies a store's ``admit_queued`` decides alone (CANCEL_IN_PROGRESS and
#: CANCEL_NEWEST take the generic path).
_ONE_CALL_STRATEGIES = frozenset({_concurrency.Strategy.REJECT, *_concurrency.QUEUEING_STRATEGIES})

#: How many ancestors a child start looks at (a backstop against a cycle of parents).
_MAX_DEPTH = 1000


def per_start(spec: _concurrency.ConcurrencySpec) -> tuple[_concurrency.Concurrency, ...]:
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


def valid_run_id(run_id: Any) -> bool:
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
