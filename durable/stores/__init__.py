"""Stores: where runs live. ``DjangoStore`` is the default."""

from durable.stores.base import RunExists, RunRecord, StepEntry, Store
from durable.stores.database import DjangoStore
from durable.stores.memory import InMemoryStore

__all__ = ["DjangoStore", "InMemoryStore", "RunExists", "RunRecord", "StepEntry", "Store"]
