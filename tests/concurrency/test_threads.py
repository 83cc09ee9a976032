"""Threads with their own connections race on one key: exact on PostgreSQL and on SQLite."""

from __future__ import annotations

import threading
import uuid

import pytest
from django.db import connection, connections

from durable import Concurrency, ConcurrencyLimitError, Engine
from durable.runtime import Registry

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 8
STARTS_EACH = 15
LIMIT = 5


def test_threads_racing_on_a_brand_new_key_admit_exactly_the_limit() -> None:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None)
    engine = Engine(dispatch=lambda engine, run_id: None, registry=registry)
    key = f"threads:{uuid.uuid4().hex}"
    barrier = threading.Barrier(THREADS)
    admitted: list[str] = []
    refused: list[int] = []
    errors: list[BaseException] = []

    def starter() -> None:
        try:
            barrier.wait(timeout=30)
            for _ in range(STARTS_EACH):
                try:
                    admitted.append(engine.start("w", {}, concurrency=Concurrency(key=key, limit=LIMIT)).run_id)
                except ConcurrencyLimitError as exc:
                    refused.append(exc.active)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=starter) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(admitted) == LIMIT, f"{len(admitted)} admitted with a limit of {LIMIT} on {connection.vendor}"
    assert len(refused) == THREADS * STARTS_EACH - LIMIT
    assert set(refused) == {LIMIT}  # every refusal saw exactly the full key
    assert engine.count_runs(tag=f"concurrency:{key}") == LIMIT
