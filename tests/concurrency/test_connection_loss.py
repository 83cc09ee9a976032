"""Database connections terminated under a running run (``pg_terminate_backend``):
neither the run nor its heartbeats die with them."""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from durable import DjangoStore, Engine
from durable.runtime import Registry
from durable.testing import wait_for
from tests.unit.conftest import RecordingDispatcher

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def terminate_other_backends() -> int:
    """Kill every other connection to the test database, as an administrator (or a
    fast restart) would: the worker's, its heartbeat thread's."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_heartbeats_survive_a_terminated_connection(settings: Any) -> None:
    engine = Engine(DjangoStore(), dispatch=RecordingDispatcher(), registry=Registry())
    in_step, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow() -> str:
        calls.append("slow")
        in_step.set()
        release.wait(60)
        return "done"

    engine.register("w", "1", lambda ctx, input: ctx.step("slow", slow))
    handle = engine.start("w", {})
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            engine.execute(handle.run_id)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert in_step.wait(30)
        claimed_at = handle.refresh().record.heartbeat_at
        assert claimed_at is not None
        # The heartbeat thread has its connection once it has beaten.
        wait_for(lambda: handle.refresh().record.heartbeat_at > claimed_at, what="a first heartbeat")  # type: ignore[operator]
        assert terminate_other_backends() >= 1
        killed_at: datetime = timezone.now()  # the heartbeat's connection is dead by now
        # The heartbeat thread reconnects: its beats go on after the kill.
        wait_for(
            lambda: handle.refresh().record.heartbeat_at > killed_at,  # type: ignore[operator]
            timeout=float(settings.DURABLE["STALE_AFTER"]) * 5,
            what="a heartbeat after the connection was terminated",
        )
        assert handle.run_id not in engine.sweep()["orphaned"]
    finally:
        release.set()
        thread.join(60)
    assert errors == []
    assert handle.result(timeout=10) == "done"
    assert calls == ["slow"]  # its journal write reconnected too: the step ran once
