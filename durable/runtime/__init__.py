"""The engine: registry, start/admission, execution and replay. It knows no Celery:
runs reach their executors through a ``Dispatcher`` (``durable.runtime.dispatch``)."""

from durable.runtime.context import WorkflowContext
from durable.runtime.dispatch import Dispatcher, InlineDispatcher, inline_dispatch
from durable.runtime.engine import Engine, RunHandle
from durable.runtime.registry import Definition, Registry, default_registry
from durable.runtime.workflow import DurableWorkflow

__all__ = [
    "Definition",
    "Dispatcher",
    "DurableWorkflow",
    "Engine",
    "InlineDispatcher",
    "Registry",
    "RunHandle",
    "WorkflowContext",
    "default_registry",
    "inline_dispatch",
]
