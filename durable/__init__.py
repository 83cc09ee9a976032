"""durable: durable workflows for Django with exact per-key concurrency quotas."""

from __future__ import annotations

from durable import tasks as _tasks
from durable.concurrency import Burst, Concurrency, Strategy
from durable.exceptions import (
    ChildWorkflowError,
    ConcurrencyLimitError,
    ConcurrencyQueueFullError,
    DurableError,
    FatalError,
    RunNotFound,
)
from durable.runtime import DurableWorkflow, Engine, RunHandle, WorkflowContext
from durable.runtime import dispatch as _dispatch
from durable.status import DEFAULT_CONCURRENCY_STATUSES, RunStatus
from durable.stores import DjangoStore, InMemoryStore

__version__ = "0.1.0"

# Engines built without a dispatcher send their runs to Celery workers.
_dispatch.set_default(_tasks.CeleryDispatcher())

#: The default engine (``DjangoStore``, Celery execution, settings from ``DURABLE``).
engine = Engine(dispatch=_dispatch.default())

__all__ = [
    "DEFAULT_CONCURRENCY_STATUSES",
    "Burst",
    "ChildWorkflowError",
    "Concurrency",
    "ConcurrencyLimitError",
    "ConcurrencyQueueFullError",
    "DjangoStore",
    "DurableError",
    "DurableWorkflow",
    "Engine",
    "FatalError",
    "InMemoryStore",
    "RunHandle",
    "RunNotFound",
    "RunStatus",
    "Strategy",
    "WorkflowContext",
    "engine",
]
