"""Stores: where runs live. ``DjangoStore`` is the default."""

from durable.stores.base import BaseStore, RunExists, RunRecord, StepEntry
from durable.stores.database import DjangoStore
from durable.stores.memory import InMemoryStore

__all__ = ["BaseStore", "DjangoStore", "InMemoryStore", "RunExists", "RunRecord", "StepEntry"]
