"""The engine: registry, start/admission, execution and replay."""

from durable.runtime.context import WorkflowContext
from durable.runtime.core import Engine, RunHandle, celery_dispatch, inline_dispatch
from durable.runtime.registry import Definition, Registry, default_registry
from durable.runtime.workflow import DurableWorkflow

__all__ = [
    "Definition",
    "DurableWorkflow",
    "Engine",
    "Registry",
    "RunHandle",
    "WorkflowContext",
    "celery_dispatch",
    "default_registry",
    "inline_dispatch",
]
