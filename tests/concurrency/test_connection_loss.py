"""Database connections terminated under a running run (``pg_terminate_backend``):
neither the run nor its heartbeats die with them."""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from durable import DjangoStore, Engine, RunStatus
from durable.runtime import Registry
from durable.testing import wait_for
from tests.threads import started
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


def allow_connections(allow: bool) -> None:
    """Open or close the test database to new connections (from the maintenance
    database: PostgreSQL will not close the database one is connected to)."""
    import psycopg

    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"],
        port=db["PORT"] or 5432,
        user=db["USER"],
        password=db["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    ) as admin:
        admin.execute(f'ALTER DATABASE "{db["NAME"]}" ALLOW_CONNECTIONS {"true" if allow else "false"}')


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
    thread = started(lambda: engine.execute(handle.run_id))
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
    thread.outcome()
    assert handle.result(timeout=10) == "done"
    assert calls == ["slow"]  # its journal write reconnected too: the step ran once


def test_a_database_outage_during_a_step_hands_the_run_to_the_sweeper(settings: Any) -> None:
    """The database refuses connections while a step runs, so the journal write fails
    even on a fresh connection: the execution ends without a verdict, the run stays
    ``running`` without heartbeats, and once the database is back the sweeper takes
    it over. Finished steps are not run again; the interrupted one is (at least once)."""
    engine = Engine(DjangoStore(), dispatch=RecordingDispatcher(), registry=Registry())
    in_step, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow() -> str:
        calls.append("slow")
        if len(calls) == 2:  # the first execution of "slow"
            in_step.set()
            release.wait(60)
        return "done"

    def body(ctx: Any, input: Any) -> Any:
        ctx.step("first", lambda: calls.append("first") or 1)
        return ctx.step("slow", slow)

    engine.register("w", "1", body)
    handle = engine.start("w", {})
    thread = started(lambda: engine.executor.execute(handle.run_id))
    try:
        assert in_step.wait(30)
        allow_connections(False)
        terminate_other_backends()
        release.set()
        assert thread.outcome() is False  # not handed back: the database could not be reached
    finally:
        release.set()
        allow_connections(True)
        thread.join(60)
    record = handle.refresh().record
    assert (record.status, record.error) == (RunStatus.RUNNING, None)
    assert engine.store.load_steps(handle.run_id)[0].name == "first"

    wait_for(lambda: handle.run_id in engine.sweep()["orphaned"], timeout=30, what="the sweeper to take the run over")
    assert engine.executor.execute(handle.run_id) is False
    assert handle.result(timeout=10) == "done"
    assert calls == ["first", "slow", "slow"]
