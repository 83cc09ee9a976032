"""``DurableBackend``: each enqueued task is a durable run with one journaled step.

The run is of one built-in workflow, ``durable.task`` (``WORKFLOW``), whose input
names the task and carries its arguments::

    {"task": "myapp.tasks.send_email", "args": [...], "kwargs": {...},
     "backend": "default", "queue_name": "default", "run_after": null, "takes_context": false}

Its body sleeps until ``run_after`` (a durable timer) and then runs the task in
one step named after the task's module path. The workflow is registered when this
module is imported; ``durable``'s app imports it in every process whose
``TASKS`` setting names it, Celery workers included.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async
from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import import_string

from durable import concurrency as _concurrency
from durable import exceptions, signals
from durable.contrib.tasks import framework
from durable.runtime.context import WorkflowContext
from durable.runtime.dispatch import InlineDispatcher
from durable.runtime.engine import Engine, RunHandle
from durable.runtime.registry import default_registry
from durable.status import RunStatus
from durable.stores.base import RunRecord, StepEntry
from durable.util import check_json, format_traceback

logger = logging.getLogger(__name__)

#: The workflow every task run is a run of.
WORKFLOW = "durable.task"
VERSION = "1"
#: ``OPTIONS["CONCURRENCY"]`` keys naming a queue start with this.
QUEUE_PREFIX = "queue:"

_STATUS = {
    RunStatus.PENDING: framework.TaskResultStatus.READY,
    RunStatus.QUEUED: framework.TaskResultStatus.READY,
    RunStatus.SUSPENDED: framework.TaskResultStatus.READY,
    RunStatus.BLOCKED: framework.TaskResultStatus.READY,
    RunStatus.RUNNING: framework.TaskResultStatus.RUNNING,
    RunStatus.COMPLETED: framework.TaskResultStatus.SUCCESSFUL,
    RunStatus.FAILED: framework.TaskResultStatus.FAILED,
    RunStatus.CANCELLED: framework.TaskResultStatus.FAILED,
    RunStatus.DEAD: framework.TaskResultStatus.FAILED,
}

#: The exception class reported for a run that ended without an exception of the
#: task's own (cancelled, dead after repeated crashes): its error type names no class.
_RUN_ENDED = "durable.exceptions.RunFailedError"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DurableTask(framework.Task):
    """The backend's ``task_class``: a ``Task`` that may carry its own quota,
    ``@task(concurrency=Concurrency(...))``, where the framework passes extra
    arguments of ``@task`` to the task class (the django-tasks backport does;
    Django's own ``django.tasks`` from 6.1). ``task.using(...)`` keeps it."""

    concurrency: _concurrency.ConcurrencySpec = None


class DurableBackend(framework.BaseTaskBackend):
    """A ``django.tasks`` backend that runs each task as a durable run.

    ``OPTIONS``:

    - ``"CONCURRENCY"``: ``{"<task module path>" | "queue:<queue name>": Concurrency | dict}``,
      the quotas of tasks (a dict holds ``Concurrency``'s arguments). Key functions and
      expressions read the run's input: ``input.kwargs.user_id``, ``input.args[0]``.
    - ``"ENGINE"``: the dotted path of the ``durable.Engine`` to use (default ``durable.engine``).
    """

    task_class = DurableTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    #: Durable executes runs in the order Celery delivers them: no priority is honoured.
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        options = dict(self.options)
        unknown = sorted(set(options) - {"CONCURRENCY", "ENGINE"})
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown options {unknown}: DurableBackend takes CONCURRENCY and ENGINE."
            )
        self._engine_path = options.get("ENGINE", "durable.engine")
        if not isinstance(self._engine_path, str):
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['ENGINE'] is the dotted path of a durable Engine, got {self._engine_path!r}."
            )
        self.concurrency = _quota_options(alias, options.get("CONCURRENCY", {}))
        for name in self.concurrency:
            if name.startswith(QUEUE_PREFIX) and self.queues and name[len(QUEUE_PREFIX) :] not in self.queues:
                raise ImproperlyConfigured(
                    f"TASKS[{alias!r}]['OPTIONS']['CONCURRENCY'] names {name!r}, which is not among the backend's "
                    f"QUEUES {sorted(self.queues)}."
                )
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            try:
                engine = import_string(self._engine_path)
            except ImportError as exc:
                raise ImproperlyConfigured(
                    f"TASKS[{self.alias!r}]['OPTIONS']['ENGINE'] = {self._engine_path!r} cannot be imported: {exc}"
                ) from exc
            if not isinstance(engine, Engine):
                raise ImproperlyConfigured(
                    f"TASKS[{self.alias!r}]['OPTIONS']['ENGINE'] = {self._engine_path!r} is not a durable Engine."
                )
            register(engine)
            self._engine = engine
        return self._engine

    # -- enqueueing ------------------------------------------------------------------
    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """Start the task's run under its quotas (``ConcurrencyLimitError`` over a
        limit, creating nothing); the result is READY, or finished already with an
        engine that executes inline."""
        self.validate_task(task)
        return self._start(task, self._input(task, args, kwargs), limits=None)

    async def aenqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """``enqueue`` for async code: an async limit function is awaited here, on
        the running loop, and the start runs in a thread, as ``Engine.astart``."""
        self.validate_task(task)
        input = self._input(task, args, kwargs)
        limits = await _concurrency.aresolve_limits(self._specs(task), input)
        return await sync_to_async(self._start)(task, input, limits=limits)

    def _start(self, task: Any, input: dict[str, Any], *, limits: _concurrency.Limits | None) -> Any:
        quotas = _concurrency.resolve(self._specs(task), input, limits=limits)
        handle = self.engine.start(WORKFLOW, input, concurrency=[_static(q) for q in quotas], queue=celery_queue(task.queue_name))
        handle.refresh()  # the row as stored: its created_at, and its status if a worker took it already
        steps = []
        if isinstance(self.engine.dispatch, InlineDispatcher) or handle.status != RunStatus.PENDING:
            # Executed in this thread already (an inline engine), or by a quick worker: say how it went.
            steps = self.engine.store.load_steps(handle.run_id)
        # task_enqueued is sent by _announce, when the start commits.
        return task_result(task, handle.record, steps)

    def _input(self, task: Any, args: Any, kwargs: Any) -> dict[str, Any]:
        """The run's input: JSON only. The framework's own normalisation first (its
        ``TypeError`` for a value it cannot take), then durable's stricter check."""
        input = {
            "task": task.module_path,
            "args": framework.normalize_json(list(args)),
            "kwargs": framework.normalize_json(dict(kwargs)),
            "backend": self.alias,
            "queue_name": task.queue_name,
            "run_after": None if task.run_after is None else task.run_after.isoformat(),
            "takes_context": bool(task.takes_context),
        }
        checked: dict[str, Any] = check_json(input, what=f"the arguments of task {task.module_path!r}")
        return checked

    def _specs(self, task: Any) -> tuple[_concurrency.Concurrency, ...]:
        """The quotas of a task: its path's and its queue's from ``OPTIONS``, and its own."""
        specs = [
            *self.concurrency.get(task.module_path, ()),
            *self.concurrency.get(QUEUE_PREFIX + task.queue_name, ()),
            *_concurrency.normalize(getattr(task, "concurrency", None)),
        ]
        return tuple(specs)

    # -- results ---------------------------------------------------------------------
    def get_result(self, result_id: str) -> Any:
        try:
            handle = self.engine.get_run(result_id)
        except exceptions.RunNotFound:
            raise framework.TaskResultDoesNotExist(result_id) from None
        return self._result(handle)

    async def aget_result(self, result_id: str) -> Any:
        return await sync_to_async(self.get_result)(result_id)

    def _result(self, handle: RunHandle) -> Any:
        if handle.workflow != WORKFLOW or not isinstance(handle.input, dict):
            raise framework.TaskResultDoesNotExist(handle.run_id)
        return task_result(self._task_of(handle.input), handle.record, self.engine.store.load_steps(handle.run_id))

    def _task_of(self, input: dict[str, Any]) -> Any:
        """The ``Task`` a run executes, with the queue and ``run_after`` it was enqueued with."""
        task = load_task(input["task"])
        run_after = _run_after(input)
        if isinstance(task, framework.Task):
            return task.using(queue_name=input["queue_name"], run_after=run_after, backend=input["backend"])
        return self.task_class(
            func=task,
            priority=framework.DEFAULT_TASK_PRIORITY,
            backend=input["backend"],
            queue_name=input["queue_name"],
            run_after=run_after,
            takes_context=bool(input.get("takes_context")),
        )

    # -- checks ----------------------------------------------------------------------
    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        messages: list[checks.CheckMessage] = list(super().check(**kwargs))
        if not apps.is_installed("durable"):
            messages.append(
                checks.Error(
                    f"TASKS[{self.alias!r}] uses durable.contrib.tasks.DurableBackend, but 'durable' is not in INSTALLED_APPS.",
                    hint="Add 'durable' (and its dependencies, see the installation docs) to INSTALLED_APPS.",
                    id="durable.E101",
                )
            )
        return messages


def celery_queue(queue_name: str) -> str:
    """The Celery queue of a task queue: the framework's default queue is durable's
    ``DURABLE["TASK_QUEUE"]`` (""), any other queue the Celery queue of that name."""
    return "" if queue_name == framework.DEFAULT_TASK_QUEUE_NAME else queue_name


def task_result(task: Any, record: RunRecord, steps: Sequence[StepEntry]) -> Any:
    """The framework's ``TaskResult`` of a task run, as of ``record`` and its journal."""
    input = record.input
    status = _STATUS[RunStatus(record.status)]
    step = next((s for s in steps if s.name == input["task"]), None)
    run_after = _run_after(input)
    started_at = step.started_at if step is not None else None
    if step is None and status == framework.TaskResultStatus.RUNNING:
        if run_after is not None and run_after > timezone.now():
            status = framework.TaskResultStatus.READY  # running only to park until run_after
        else:
            started_at = _latest(record.started_at, run_after)
    errors: list[Any] = []
    if status == framework.TaskResultStatus.FAILED:
        errors.append(_task_error(record.error))
    result: Any = framework.TaskResult(
        task=task,
        id=record.run_id,
        status=status,
        enqueued_at=record.created_at,
        started_at=started_at,
        finished_at=record.finished_at if record.status in _FINISHED else None,
        last_attempted_at=started_at,
        args=input["args"],
        kwargs=input["kwargs"],
        backend=input["backend"],
        errors=errors,
        worker_ids=[record.worker] if record.worker and started_at is not None else [],
    )
    if status == framework.TaskResultStatus.SUCCESSFUL:
        framework.set_field(result, "_return_value", record.output)
    return result


_FINISHED = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD})


def _task_error(error: Any) -> Any:
    """The framework's ``TaskError`` of a failed run's ``error``."""
    error = error if isinstance(error, dict) else {}
    path = str(error.get("type") or _RUN_ENDED)
    traceback = str(error.get("traceback") or error.get("message") or "")
    if path == _EXITED:
        # What the task raised, with its own traceback (the step records it as TaskExited).
        path, traceback = "builtins.SystemExit", str(error.get("message") or traceback)
    elif path.startswith("durable.") and path.count(".") == 1:
        # durable.cancelled, durable.dead, ...: the run ended without an exception of the task's.
        path = _RUN_ENDED
    return framework.TaskError(exception_class_path=path, traceback=traceback)


def _latest(*moments: datetime | None) -> datetime | None:
    known = [m for m in moments if m is not None]
    return max(known) if known else None


def _run_after(input: Mapping[str, Any]) -> datetime | None:
    value = input.get("run_after")
    return None if value is None else datetime.fromisoformat(value)


def _static(quota: _concurrency.Quota) -> _concurrency.Concurrency:
    """A resolved quota as the per-start ``Concurrency`` the engine takes."""
    burst = None if quota.burst is None else _concurrency.Burst(quota.burst.pool, quota.burst.up_to)
    return _concurrency.Concurrency(
        key=quota.key,
        limit=quota.limit,
        count_statuses=quota.count_statuses,
        strategy=quota.strategy,
        max_queued=quota.max_queued,
        burst=burst,
    )


def _quota_options(alias: str, value: Any) -> dict[str, tuple[_concurrency.Concurrency, ...]]:
    """``OPTIONS["CONCURRENCY"]`` checked: each entry a ``Concurrency``, a dict of its
    arguments, or a list of those."""
    where = f"TASKS[{alias!r}]['OPTIONS']['CONCURRENCY']"
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(f"{where} maps task module paths and 'queue:<name>' to quotas, got {value!r}.")
    quotas: dict[str, tuple[_concurrency.Concurrency, ...]] = {}
    for name, spec in value.items():
        if not isinstance(name, str) or not name or name == QUEUE_PREFIX:
            raise ImproperlyConfigured(f"{where}: {name!r} is neither a task's module path nor 'queue:<name>'.")
        entries = spec if isinstance(spec, (list, tuple)) else [spec]
        built = []
        for entry in entries:
            try:
                if isinstance(entry, _concurrency.Concurrency):
                    built.append(entry)
                elif isinstance(entry, Mapping):
                    built.append(_concurrency.Concurrency(**dict(entry)))
                else:
                    raise TypeError(f"got {entry!r}")
            except (TypeError, exceptions.InvalidStartError) as exc:
                raise ImproperlyConfigured(
                    f"{where}[{name!r}] must be a durable.Concurrency or a dict of its arguments "
                    f"(key or expression, limit, strategy, ...): {exc}"
                ) from exc
        quotas[name] = tuple(built)
    return quotas


# -- the workflow ----------------------------------------------------------------------
def load_task(path: str) -> Any:
    """The task (or plain function) at ``path``, a module path."""
    try:
        return import_string(path)
    except ImportError as exc:
        raise exceptions.FatalError(f"The task {path!r} cannot be imported here: {exc}") from exc


class TaskExited(Exception):  # noqa: N818  (it says what happened)
    """The task raised ``SystemExit``: the worker keeps running, the task fails (its
    result's error names ``SystemExit``; the message is that exception's traceback)."""


_EXITED = f"{TaskExited.__module__}.{TaskExited.__qualname__}"


def _call_task(run_id: str, input: dict[str, Any]) -> Any:
    """The run's one step: import the task and call it with the run's arguments,
    sending the framework's ``task_started`` and ``task_finished`` around the call."""
    task = load_task(input["task"])
    func = task.func if isinstance(task, framework.Task) else task
    args = list(input["args"])
    backend = _backend(input["backend"])
    current = None
    if backend is not None:
        try:
            current = backend.get_result(run_id)
        except framework.TaskResultDoesNotExist:  # the backend's ENGINE does not see this run
            backend = None
    if input.get("takes_context"):
        if current is None:
            raise exceptions.FatalError(
                f"Task {input['task']!r} takes a context, and TASKS[{input['backend']!r}] is no DurableBackend "
                "that sees this run in this worker: configure the same TASKS in every process."
            )
        args.insert(0, framework.TaskContext(task_result=current))
    if current is not None:
        framework.task_started.send(type(backend), task_result=current)
    try:
        if inspect.iscoroutinefunction(func):
            value = async_to_sync(func)(*args, **input["kwargs"])
        else:
            value = func(*args, **input["kwargs"])
        value = framework.normalize_json(value)
    except BaseException as exc:
        if current is not None and not isinstance(exc, (KeyboardInterrupt, exceptions.Suspend, exceptions.RunCancelled)):
            _finished(backend, current, framework.TaskResultStatus.FAILED, error=exc)
        if isinstance(exc, SystemExit):
            # Its message is the SystemExit's traceback, what the result reports.
            raise TaskExited(format_traceback(exc)) from None
        raise
    if current is not None:
        _finished(backend, current, framework.TaskResultStatus.SUCCESSFUL, value=value)
    return value


def _backend(alias: str) -> DurableBackend | None:
    """The backend of ``alias`` in this process, if it is a ``DurableBackend``."""
    try:
        backend = framework.task_backends[alias]
    except Exception:  # an alias gone from TASKS, a backend that cannot be built here
        logger.warning("TASKS[%r] cannot be loaded in this process: the task runs without the framework's signals.", alias)
        return None
    return backend if isinstance(backend, DurableBackend) else None


def _finished(backend: Any, result: Any, status: Any, *, value: Any = None, error: BaseException | None = None) -> None:
    """Send ``task_finished`` with ``result`` as it ends (the run records it just after)."""
    framework.set_field(result, "status", status)
    framework.set_field(result, "finished_at", timezone.now())
    if error is not None:
        path = f"{type(error).__module__}.{type(error).__qualname__}"
        result.errors.append(framework.TaskError(exception_class_path=path, traceback=format_traceback(error)))
    else:
        framework.set_field(result, "_return_value", value)
    try:
        framework.task_finished.send(type(backend), task_result=result)
    except Exception:  # a receiver's failure is not the task's
        logger.exception("A task_finished receiver failed for task run %s", result.id)


def run_task(ctx: WorkflowContext, input: dict[str, Any]) -> Any:
    """The body of ``durable.task``: wait for ``run_after``, then run the task once."""
    run_after = _run_after(input)
    if run_after is not None:
        ctx.sleep_until(run_after)
    return ctx.step(input["task"], _call_task, ctx.run_id, input)


def _announce(sender: Engine, run_id: str, workflow: str, **kwargs: Any) -> None:
    """The framework's ``task_enqueued`` for a task run, once its start commits: after
    a rollback nothing was enqueued, and it comes before the run can reach a worker
    (an inline engine executes the run right after). Receives durable's internal
    ``_run_created``, as ``durable.contrib.prometheus`` does."""
    if workflow != WORKFLOW:
        return
    handle = sender.get_run(run_id)
    backend = _backend(handle.input["backend"]) if isinstance(handle.input, dict) else None
    if backend is not None:
        result = task_result(backend._task_of(handle.input), handle.record, [])
        framework.task_enqueued.send(type(backend), task_result=result)


def register(engine: Engine) -> None:
    """Register ``durable.task`` with ``engine``'s registry (once)."""
    try:
        engine.registry.get(WORKFLOW, VERSION)
    except exceptions.UnknownWorkflowError:
        engine.registry.register(WORKFLOW, VERSION, run_task)


default_registry.register(WORKFLOW, VERSION, run_task)
signals._run_created.connect(_announce, dispatch_uid="durable.contrib.tasks")
