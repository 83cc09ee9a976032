"""``WorkflowContext``: what a workflow body uses to run journaled steps."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from durable import concurrency, exceptions, signals
from durable.concurrency import Concurrency, Quota, Strategy
from durable.status import DEFAULT_CONCURRENCY_STATUSES, TERMINAL_STATUSES, RunStatus
from durable.stores.base import SLOT_WAIT_PREFIX, RunRecord, StepEntry
from durable.util import check_json, describe_error

if TYPE_CHECKING:
    from durable.runtime.engine import Engine, RunHandle

logger = logging.getLogger(__name__)

Backoff = float | Callable[[int], float]


class StepFailedError(exceptions.DurableError):
    """A step failed after its retries; on replay the recorded failure is raised again.

    A replay raises the step's original exception type when it can (see
    ``WorkflowContext.step``); otherwise a ``StepFailedError``, which is also an
    instance of the original class when that class is loaded in the worker.
    """

    code = "step_failed"

    step: str
    error: dict[str, Any]


class WorkflowContext:
    """Passed to a workflow body as ``ctx``.

    Steps are journaled by position: on replay (after a crash or a restart) a step
    that finished already returns its recorded result and its function is not
    called again. Step names must follow the same order on every execution.
    """

    def __init__(
        self,
        engine: Engine,
        run: RunRecord,
        lease: str,
        journal: list[StepEntry],
        lost: threading.Event | None = None,
        *,
        claimed: bool = False,
    ) -> None:
        self.engine = engine
        self.run = run
        self._lease = lease
        #: Set by the heartbeat when the run no longer belongs to this execution.
        self._lost = lost
        self._journal = {step.position: step for step in journal}
        self._position = 0
        #: The claim that read ``journal`` just proved the run this lease's: the
        #: first step to run needs no read to prove it again (its journal write
        #: checks the lease, as every write does). Spent by the first store call.
        self._claimed = claimed

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def input(self) -> Any:
        return self.run.input

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retries: int = 0,
        backoff: Backoff = 1.0,
        concurrency: Concurrency | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once for this run and journal its JSON result.

        ``retries`` more attempts are made after an exception (``FatalError`` is
        never retried), waiting ``backoff * 2**(attempt-1)`` seconds (or
        ``backoff(attempt)`` when it is a function) in between.

        The exception of the last attempt propagates to the body. A replay raises
        it again from the journal: the same class rebuilt from its recorded
        arguments when the class is loaded in the worker and the arguments are
        JSON values, else a ``StepFailedError`` that is also an instance of that
        class (so ``except ThatClass`` catches it the same way), else a plain
        ``StepFailedError``.

        ``concurrency``: a step-level quota, at most ``limit`` steps of ``key``
        running their body at once across every run and worker. A step that finds
        the key full parks the run (no worker held) until a slot is handed to it,
        oldest first; with ``strategy=Strategy.REJECT`` it raises
        ``ConcurrencyLimitError`` instead, journaled (a replay raises it again).
        The slot is held through the step's retries and given back when its
        result is journaled. A key function or expression reads the run's input.
        """
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
        if concurrency is not None:
            _check_step_quota(concurrency, name)
        position, recorded = self._next(name)
        if recorded is not None:
            if recorded.outcome == "completed":
                return recorded.output
            raise _recorded_failure(name, recorded.error)
        quota = None if concurrency is None else _resolve_step_quota(concurrency, self.input)
        if quota is None:
            self._ensure_running()
            return self._run_step(position, name, fn, args, kwargs, retries, backoff)
        self._take_slot(position, name, quota)
        try:
            return self._run_step(position, name, fn, args, kwargs, retries, backoff)
        finally:
            self._give_slot(position, quota.key)

    def _run_step(
        self,
        position: int,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retries: int,
        backoff: Backoff,
    ) -> Any:
        started = timezone.now()
        attempt = 0
        while True:
            attempt += 1
            try:
                # What the step returns is what a replay will return: the JSON round trip.
                output = check_json(fn(*args, **kwargs), what=f"the result of step {name!r}")
            except (exceptions.RunCancelled, exceptions.Suspend):
                raise
            except Exception as exc:
                fatal = isinstance(exc, (exceptions.FatalError, exceptions.InvalidStartError))
                if fatal or attempt > retries:
                    error = describe_error(exc, with_args=True, with_traceback=True)
                    entry = StepEntry(position, name, "failed", error=error, attempts=attempt, started_at=started)
                    self._record(entry)
                    if signals.step_finished.has_listeners(self.engine):
                        self._step_finished(entry)
                    raise
                delay = backoff(attempt) if callable(backoff) else float(backoff) * 2 ** (attempt - 1)
                logger.info(
                    "Step %r of run %s failed (attempt %d), retrying in %.2fs: %s", name, self.run_id, attempt, delay, exc
                )
                time.sleep(max(0.0, delay))
                self.engine.store.recover()  # a step that lost its database connection retries on a fresh one
                self._ensure_running()
                continue
            entry = StepEntry(position, name, "completed", output=output, attempts=attempt, started_at=started)
            self._record(entry)
            if signals.step_finished.has_listeners(self.engine):
                self._step_finished(entry)
            return output

    # -- step-level quotas -------------------------------------------------------------------
    def _take_slot(self, position: int, name: str, quota: Quota) -> None:
        """Take a slot of the step's quota (the store checks the lease under the key's
        lock), or park the run for one, or raise the journaled refusal (``REJECT``)."""
        self._check_lease()
        self._claimed = False
        queue = quota.strategy is not Strategy.REJECT
        with _store_call():
            answer = self.engine.store.acquire_slot(
                self.run_id, self._lease, position, key=quota.key, limit=quota.limit, queue=queue
            )
        if answer.woken:
            self.engine.executor.slots_handed([(quota.key, run_id) for run_id in answer.woken])
        if answer.outcome == "held":
            return
        if answer.outcome == "waiting":
            raise exceptions.Suspend(SLOT_WAIT_PREFIX + quota.key, parked=True)
        if answer.outcome != "full":
            raise exceptions.RunCancelled(self.run_id)
        fields: dict[str, Any] = {
            "workflow": self.run.workflow,
            "key": quota.key,
            "limit": answer.limit,
            "active": answer.active,
            "hint": f"Step {name!r} was refused: {answer.active} steps of this key hold its {answer.limit} slots.",
        }
        refusal = exceptions.ConcurrencyLimitError(**fields)
        error = {"type": _REFUSAL_TYPE, "message": str(refusal), "quota": fields}
        entry = StepEntry(position, name, "failed", error=error)
        self._record(entry)
        if signals.step_finished.has_listeners(self.engine):
            self._step_finished(entry)
        raise refusal

    def _give_slot(self, position: int, key: str) -> None:
        """The step ended (journaled, or stopped): give its slot back and hand it on.
        Best effort: a slot whose step is journaled or whose run ended counts no more,
        and the sweeper hands it on."""
        store = self.engine.store
        try:
            started, woken = store.release_slot_waking(self.run_id, position, key=key, lease=self._lease)
        except Exception:
            logger.warning("Run %s could not hand on its slot of %s; the sweeper does.", self.run_id, key, exc_info=True)
            with contextlib.suppress(Exception):  # drop a connection the error left unusable
                store.recover()
            return
        if started or woken:
            self.engine.executor.slots_handed([(key, run_id) for run_id in woken], started=started)

    def _step_finished(self, entry: StepEntry) -> None:
        """Send ``step_finished`` for the step just journaled, on commit."""
        finished_at = timezone.now()
        started_at = entry.started_at or finished_at
        signals.send_on_commit(
            self.engine.store.on_commit,
            signals.step_finished,
            self.engine,
            run_id=self.run_id,
            workflow=self.run.workflow,
            namespace=self.run.namespace,
            step=entry.name,
            position=entry.position,
            outcome=entry.outcome,
            attempts=entry.attempts,
            output=entry.output,
            error=entry.error,
            started_at=started_at,
            finished_at=finished_at,
            duration=max(0.0, (finished_at - started_at).total_seconds()),
        )

    def now(self) -> datetime:
        """The current time, journaled: a replay sees the same value."""
        return datetime.fromisoformat(self.step("durable.now", lambda: timezone.now().isoformat()))

    # -- waiting -----------------------------------------------------------------------
    def sleep(self, seconds: float) -> None:
        """Park the run ``suspended`` for ``seconds``; no worker is held meanwhile.

        The wake time is stored in the database, so the run wakes on time even if
        every worker restarts in between.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValueError(f"sleep() takes a non-negative number of seconds, got {seconds!r}")
        self._sleep(lambda: timezone.now() + timedelta(seconds=seconds))

    def sleep_until(self, when: datetime) -> None:
        """Park the run ``suspended`` until ``when`` (an aware datetime)."""
        if not isinstance(when, datetime) or timezone.is_naive(when):
            raise ValueError(f"sleep_until() takes an aware datetime, got {when!r}")
        self._sleep(lambda: when)

    def _sleep(self, until: Callable[[], datetime]) -> None:
        position, recorded = self._next("durable.sleep")
        if recorded is not None and recorded.outcome == "completed":
            return
        wake_at = self._deadline(position, recorded, "durable.sleep", until)
        assert wake_at is not None
        if timezone.now() >= wake_at:
            self._record(StepEntry(position, "durable.sleep", "completed", output={"until": wake_at.isoformat()}))
            return
        raise exceptions.Suspend("sleep", wake_at)

    def wait_for_signal(self, name: str, timeout: float | None = None) -> Any:
        """Wait until signal ``name`` is sent to this run and return its payload.

        The run is parked ``suspended`` meanwhile. A signal sent before the run
        waits is buffered, not lost. After ``timeout`` seconds without the signal,
        raises ``SignalTimeout`` (which the workflow may catch).
        """
        if not isinstance(name, str) or not name or len(name) > 255:
            raise ValueError(f"A signal name must be a string of 1 to 255 characters, got {name!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be None or a non-negative number of seconds, got {timeout!r}")
        step_name = f"durable.signal:{name}"
        position, recorded = self._next(step_name)
        if recorded is not None and recorded.outcome == "completed":
            return recorded.output["payload"]
        if recorded is not None and recorded.outcome == "failed":
            raise exceptions.SignalTimeout(recorded.error["message"], signal=name)
        self._check_lease()
        self._claimed = False
        with _store_call():
            found, payload = self.engine.store.consume_signal(
                self.run_id, self._lease, name, StepEntry(position, step_name, "completed")
            )
        if found:
            return payload
        self._ensure_running()
        deadline = None
        if timeout is not None:
            deadline = self._deadline(position, recorded, step_name, lambda: timezone.now() + timedelta(seconds=timeout))
            assert deadline is not None
            if timezone.now() >= deadline:
                message = f"No signal {name!r} arrived within {timeout}s."
                error = {"type": "durable.exceptions.SignalTimeout", "message": message}
                self._record(StepEntry(position, step_name, "failed", error=error))
                raise exceptions.SignalTimeout(message, signal=name)
        raise exceptions.Suspend(f"signal:{name}", deadline)

    # -- children ------------------------------------------------------------------------
    def child(
        self,
        workflow: Any,
        input: Any = None,
        run_id: str | None = None,
        concurrency: Any = None,
    ) -> Any:
        """Start a child workflow and wait for it; return its output.

        Raises ``ChildWorkflowError`` when the child fails, is cancelled, or could
        not start (its ``__cause__`` is then the ``ConcurrencyLimitError``).
        """
        name = _workflow_name(workflow)
        step_name = f"durable.child:{name}"
        position, recorded = self._next(step_name)
        if recorded is not None and recorded.outcome == "completed":
            return recorded.output["output"]
        if recorded is not None and recorded.outcome == "failed":
            raise _child_error(recorded.error)
        if recorded is not None:  # waiting: started before
            child_id = recorded.output["run_id"]
        else:
            child_id = self._start_child(name, input, run_id, concurrency, position, step_name).run_id
            self._record(StepEntry(position, step_name, "waiting", output={"run_id": child_id}))
        with _store_call():
            child = self.engine.store.get_run(child_id)
        assert child is not None
        if child.status in TERMINAL_STATUSES:
            if child.status == RunStatus.COMPLETED:
                self._record(StepEntry(position, step_name, "completed", output={"run_id": child_id, "output": child.output}))
                return child.output
            error = _child_failure(child)
            self._record(StepEntry(position, step_name, "failed", output={"run_id": child_id}, error=error))
            raise _child_error(error)
        raise exceptions.Suspend(f"child:{child_id}")

    def start_child(
        self,
        workflow: Any,
        input: Any = None,
        run_id: str | None = None,
        concurrency: Any = None,
    ) -> RunHandle:
        """Start a child workflow without waiting; return its handle (journaled: a
        replay returns the same child). Raises ``ChildWorkflowError`` if it could not start."""
        name = _workflow_name(workflow)
        step_name = f"durable.start_child:{name}"
        position, recorded = self._next(step_name)
        if recorded is not None and recorded.outcome == "completed":
            with _store_call():
                return self.engine.in_namespace(self.run.namespace).get_run(recorded.output["run_id"])
        if recorded is not None and recorded.outcome == "failed":
            raise _child_error(recorded.error)
        handle = self._start_child(name, input, run_id, concurrency, position, step_name)
        self._record(StepEntry(position, step_name, "completed", output={"run_id": handle.run_id}))
        return handle

    def _start_child(
        self, name: str, input: Any, run_id: str | None, concurrency: Any, position: int, step_name: str
    ) -> RunHandle:
        self._ensure_running()
        child_id = run_id or f"{self.run_id}:{position}"
        try:
            with _store_call():
                handle = self.engine.in_namespace(self.run.namespace).start(
                    name, input, run_id=child_id, concurrency=concurrency, parent_run_id=self.run_id
                )
        except exceptions.ConcurrencyLimitError as exc:
            error = {
                "type": "durable.exceptions.ChildWorkflowError",
                "message": f"Child workflow {name!r} could not start: {exc}",
                "cause": {"code": exc.code, **{k: v for k, v in exc.fields.items()}},
            }
            self._record(StepEntry(position, step_name, "failed", error=error))
            raise _child_error(error) from exc
        if handle.record.parent_run_id != self.run_id:
            # An explicit run id naming a run that is not this run's child: nothing
            # would ever wake the parent for it.
            error = {
                "type": "durable.exceptions.ChildWorkflowError",
                "message": f"Run id {child_id!r} belongs to a run that is not a child of {self.run_id!r}.",
            }
            self._record(StepEntry(position, step_name, "failed", error=error))
            raise _child_error(error)
        return handle

    # -- journal ---------------------------------------------------------------------------
    def _next(self, name: str) -> tuple[int, StepEntry | None]:
        """Take the next journal position; check a recorded entry there has ``name``."""
        position = self._position
        self._position += 1
        recorded = self._journal.get(position)
        if recorded is not None and recorded.name != name:
            raise exceptions.NonDeterminismError(
                f"Run {self.run_id!r} recorded step {recorded.name!r} at position {position}, "
                f"but the workflow code now runs step {name!r} there. Deploy the new code under a "
                "new workflow version so in-flight runs finish on the old one.",
                position=position,
                recorded=recorded.name,
                current=name,
            )
        return position, recorded

    def _deadline(self, position: int, recorded: StepEntry | None, name: str, compute: Callable[[], datetime]) -> datetime | None:
        """The deadline journaled at ``position``, or computed now and journaled (``waiting``)."""
        if recorded is not None and recorded.outcome == "waiting":
            return datetime.fromisoformat(recorded.output["until"])
        until = compute()
        self._record(StepEntry(position, name, "waiting", output={"until": until.isoformat()}))
        return until

    def _record(self, entry: StepEntry) -> None:
        self._check_lease()
        self._claimed = False
        with _store_call():
            recorded = self.engine.store.record_step(self.run_id, self._lease, entry)
        if not recorded:
            # Cancelled (or taken over after we were presumed dead): stop here.
            raise exceptions.RunCancelled(self.run_id)

    def _check_lease(self) -> None:
        """Stop at this step boundary if the heartbeat found the run taken from us."""
        if self._lost is not None and self._lost.is_set():
            raise exceptions.RunCancelled(self.run_id)

    def _ensure_running(self) -> None:
        """Stop here unless the run is still this execution's: the heartbeat's verdict,
        then a read of the run, except right after the claim (which proved it)."""
        self._check_lease()
        if self._claimed:
            self._claimed = False
            return
        with _store_call():
            self.engine.ensure_running(self.run_id, self._lease)


@contextmanager
def _store_call() -> Iterator[None]:
    """Around durable's own store calls from the body: their errors (a dropped
    connection, a database restart) are not the workflow's, so they leave as
    ``StoreUnavailable``, which the body's ``except Exception`` does not catch.
    Durable's own refusals (``DurableError``: a full quota, bad child input) pass,
    except ``PoolBusyError`` (a busy burst pool inside a transaction): the execution
    is tried again, as after a database error."""
    try:
        yield
    except exceptions.PoolBusyError as exc:
        raise exceptions.StoreUnavailable(str(exc)) from exc
    except exceptions.DurableError:
        raise
    except Exception as exc:
        raise exceptions.StoreUnavailable(describe_error(exc)["message"]) from exc


#: The journaled ``type`` of a step refused by its quota (``Strategy.REJECT``).
_REFUSAL_TYPE = "durable.exceptions.ConcurrencyLimitError"


def _check_step_quota(spec: Any, name: str) -> None:
    """What a step-level quota may say: one ``Concurrency``, queueing (the default,
    or ``GROUP_ROUND_ROBIN``) or ``REJECT``, without run-level options (``max_queued``,
    ``count_statuses``, ``burst``)."""
    if not isinstance(spec, Concurrency):
        raise TypeError(f"ctx.step({name!r}, concurrency=...) takes one Concurrency, got {spec!r}.")
    if spec.strategy_given and spec.strategy not in (Strategy.REJECT, Strategy.GROUP_ROUND_ROBIN):
        raise exceptions.InvalidStartError(
            f"Step {name!r}: a step's quota waits for a slot (the default) or, with Strategy.REJECT, "
            f"raises ConcurrencyLimitError; {spec.strategy} applies to runs only."
        )
    if spec.max_queued is not None:
        raise exceptions.InvalidStartError(f"Step {name!r}: max_queued applies to a run's quota only.")
    if spec.burst is not None:
        raise exceptions.InvalidStartError(
            f"Step {name!r}: burst applies to a run's quota only (a step never borrows from a pool); "
            "raise the step key's limit instead."
        )
    if tuple(spec.count_statuses) != DEFAULT_CONCURRENCY_STATUSES:
        raise exceptions.InvalidStartError(
            f"Step {name!r}: count_statuses applies to a run's quota only (a step holds its slot while its body runs)."
        )


def _resolve_step_quota(spec: Concurrency, input: Any) -> Quota | None:
    """The step's key and limit (a key function or expression reads the run's input);
    None when the key is None (the step is unlimited). ``strategy``: REJECT when
    asked for, else GROUP_ROUND_ROBIN (wait for a slot)."""
    quotas = concurrency.resolve([spec], input)
    if not quotas:
        return None
    reject = spec.strategy_given and spec.strategy is Strategy.REJECT
    return replace(quotas[0], strategy=Strategy.REJECT if reject else Strategy.GROUP_ROUND_ROBIN)


def _recorded_failure(name: str, error: dict[str, Any]) -> Exception:
    """What a replay raises for a step whose failure is journaled (see ``WorkflowContext.step``).

    No pickle and no import: the class is looked up only among modules this process
    has loaded already, and must be an ``Exception``. A step refused by its quota
    raises the same ``ConcurrencyLimitError`` again.
    """
    quota = error.get("quota")
    if error.get("type") == _REFUSAL_TYPE and isinstance(quota, dict):
        return exceptions.ConcurrencyLimitError(**quota)
    message = f"Step {name!r} failed: {error.get('message', '')}"
    cls = _loaded_exception_class(str(error.get("type", "")))
    if cls is not None:
        args = error.get("args")
        if isinstance(args, list):
            try:
                rebuilt = cls(*args)
            except Exception:  # its constructor wants something else: wrap instead
                rebuilt = None
            if type(rebuilt) is cls and str(rebuilt) == error.get("message"):
                return rebuilt
        wrapper = _failure_class(cls)
        if wrapper is not None:
            failure = Exception.__new__(wrapper)  # not cls.__init__: its arguments are unknown
            failure.args = (message,)
            failure.step, failure.error = name, error
            failure.fields = {"step": name, "error": error}
            return failure
    return StepFailedError(message, step=name, error=error)


def _loaded_exception_class(path: str) -> type[Exception] | None:
    """The ``Exception`` subclass named ``<module>.<qualname>`` if its module is loaded."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is None:
            continue
        found: Any = module
        for attr in parts[split:]:
            found = getattr(found, attr, None)
        if isinstance(found, type) and issubclass(found, Exception):
            return found
        return None
    return None


_failure_classes: dict[type[Exception], type[StepFailedError] | None] = {}
_failure_classes_lock = threading.Lock()


def _failure_class(cls: type[Exception]) -> type[StepFailedError] | None:
    """A ``StepFailedError`` that is also a ``cls`` (one class per ``cls``), or None
    when the two cannot be combined (built-in exceptions of another memory layout)."""
    with _failure_classes_lock:
        if cls not in _failure_classes:
            try:
                made: type[StepFailedError] | None = type(
                    f"StepFailedError[{cls.__name__}]", (StepFailedError, cls), {"__module__": __name__}
                )
            except TypeError:
                made = None
            _failure_classes[cls] = made
        return _failure_classes[cls]


def _workflow_name(workflow: Any) -> str:
    name = workflow if isinstance(workflow, str) else getattr(workflow, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"A child workflow is a DurableWorkflow class or a workflow name, got {workflow!r}")
    return name


def _child_failure(child: RunRecord) -> dict[str, Any]:
    reason = (child.error or {}).get("message", "") if isinstance(child.error, dict) else ""
    return {
        "type": "durable.exceptions.ChildWorkflowError",
        "message": f"Child run {child.run_id!r} ({child.workflow}) ended {child.status}" + (f": {reason}" if reason else "."),
        "child": {"run_id": child.run_id, "status": child.status, "error": child.error},
    }


def _child_error(error: dict[str, Any]) -> exceptions.ChildWorkflowError:
    """The ChildWorkflowError a journal entry describes; a refused start keeps its
    ConcurrencyLimitError as ``__cause__``, on replay too."""
    exc = exceptions.ChildWorkflowError(error["message"], child=error.get("child"))
    cause = error.get("cause")
    if cause:
        fields = {k: cause[k] for k in ("workflow", "key", "limit", "active")}
        fields.update({k: cause[k] for k in exceptions.BURST_FIELDS if k in cause})  # a burst's refusal
        if cause.get("code") == exceptions.ConcurrencyQueueFullError.code:
            exc.__cause__ = exceptions.ConcurrencyQueueFullError(**fields, queued=cause["queued"], max_queued=cause["max_queued"])
        else:
            exc.__cause__ = exceptions.ConcurrencyLimitError(**fields)
    return exc
