"""durable: durable workflows for Django with exact per-key concurrency quotas."""

from __future__ import annotations

from durable.concurrency import Concurrency, Strategy
from durable.exceptions import (
    ChildWorkflowError,
    ConcurrencyLimitError,
    ConcurrencyQueueFullError,
    DurableError,
    FatalError,
    RunNotFound,
)
from durable.runtime import DurableWorkflow, Engine, RunHandle, WorkflowContext
from durable.status import DEFAULT_CONCURRENCY_STATUSES, RunStatus
from durable.stores import DjangoStore, InMemoryStore

__version__ = "0.1.0"

#: The default engine (``DjangoStore``, Celery execution, settings from ``DURABLE``).
engine = Engine()

__all__ = [
    "DEFAULT_CONCURRENCY_STATUSES",
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

