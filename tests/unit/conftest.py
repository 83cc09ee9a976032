"""Engines on both stores, with a dispatcher that records instead of sending."""

from __future__ import annotations

from typing import Any

import pytest

from durable import DjangoStore, Engine, InMemoryStore
from durable.runtime import Dispatcher, Registry
from durable.stores import RunRecord


class RecordingDispatcher(Dispatcher):
    """Records what the engine sends to workers (and revokes). No ``wake_later``:
    the sweeper wakes sleepers, as it does when a timer is lost."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.revoked: list[str] = []

    def send(self, engine: Engine, run: RunRecord) -> None:
        self.sent.append(run.run_id)

    def revoke(self, engine: Engine, run: RunRecord) -> None:
        self.revoked.append(run.run_id)


@pytest.fixture(params=["django", "memory"])
def store(request: pytest.FixtureRequest) -> Any:
    return DjangoStore() if request.param == "django" else InMemoryStore()


@pytest.fixture
def dispatcher() -> RecordingDispatcher:
    return RecordingDispatcher()


@pytest.fixture
def engine(store: Any, dispatcher: RecordingDispatcher) -> Engine:
    return Engine(store, dispatch=dispatcher, registry=Registry())
