"""A Celery worker keeps one PostgreSQL connection per thread for durable's
lifecycle statements (``KEEP_WORKER_CONNECTION``, ``durable.stores.kept``), though
Celery's Django fix-up closes Django's connections around every task: real worker
processes, observed from ``pg_stat_activity``."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any

import pytest
from django.db import connection

from durable import RunStatus, engine
from durable.testing import wait_for
from tests.processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

LOGGED = {"DURABLE_LOG_LEVEL": "INFO"}

#: When the running test began, on the database's clock (``this_tests_connections``).
_test_began: list[datetime] = []


@pytest.fixture(autouse=True)
def this_tests_connections() -> None:
    """``lifecycle_backends`` sees the connections opened since the test began: not
    one that an earlier module's worker thread still keeps (seen with another order
    of the modules)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        _test_began[:] = [cursor.fetchone()[0]]


def lifecycle_backends() -> list[tuple[int, datetime]]:
    """The other idle connections to the test database, opened since the test began,
    whose last statement was a run's finish (``durable_end``): (pid, when the
    connection was opened)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state = 'idle' AND query LIKE 'SELECT durable_end(%%' "
            "AND backend_start >= %s",
            _test_began,
        )
        return [(int(pid), started) for pid, started in cursor.fetchall()]


def run_some(count: int, prefix: str) -> list[Any]:
    handles = [engine.start("test.add", {"a": i, "b": 1, "key": f"{prefix}-{i}"}) for i in range(count)]
    for i, handle in enumerate(handles):
        assert handle.result(timeout=60) == {"total": i + 1}
    return [handle.refresh().record for handle in handles]


def ready(workers: WorkerProcesses, name: str, **options: Any) -> Any:
    proc = workers.start(name, pool="threads", concurrency=1, **options)
    wait_for(lambda: " ready." in workers.log(name), timeout=60, what=f"worker {name} to be ready")
    return proc


def test_a_worker_executes_every_run_on_the_one_connection_its_thread_keeps(worker_processes: WorkerProcesses) -> None:
    ready(worker_processes, "kept", env=LOGGED)

    records = run_some(8, "kept")

    # Celery closed Django's connection after every task; the kept one served them all.
    kept = lifecycle_backends()
    assert len(kept) == 1
    (pid, opened) = kept[0]
    assert opened < max(r.started_at for r in records)  # opened before the last run was claimed
    # Nothing about a connection per run to advise: durable keeps its own.
    assert "every run this worker executes opens a new PostgreSQL connection" not in worker_processes.log("kept")

    run_some(3, "again")
    assert lifecycle_backends() == kept  # the same backend, still open


def test_without_it_every_run_uses_django_s_connection_which_celery_closes(worker_processes: WorkerProcesses) -> None:
    ready(worker_processes, "django", env={**LOGGED, "DURABLE_KEEP_WORKER_CONNECTION": "0"})

    records = run_some(4, "django")

    assert all(r.status == RunStatus.COMPLETED for r in records)
    assert lifecycle_backends() == []  # each run's connection was closed after its task
    assert "every run this worker executes opens a new PostgreSQL connection" in worker_processes.log("django")


def test_a_kept_connection_that_died_while_idle_costs_no_redelivery(worker_processes: WorkerProcesses) -> None:
    """A database restart (``pg_terminate_backend``) between two runs: the next claim
    fails on the dead connection and is made again at once on a new one."""
    ready(worker_processes, "blip", env=LOGGED)
    run_some(2, "before")
    [(pid, _)] = lifecycle_backends()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        assert cursor.fetchone()[0] is True

    [record] = run_some(1, "after")

    log = worker_processes.log("blip")
    assert "its claim lost the database connection, claiming it again" in log
    assert "could not be claimed" not in log
    assert record.attempt == 1 and record.error is None
    [(new_pid, _)] = lifecycle_backends()
    assert new_pid != pid


def sessions() -> int:
    """Sessions ever opened to the test database (each connection is one)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def settled_sessions() -> int:
    """``sessions`` once it stops moving (a backend reports its session when it ends)."""
    seen = [sessions()]
    while True:
        time.sleep(0.6)
        seen.append(sessions())
        if seen[-1] == seen[-2]:
            return seen[-1]


def wait_for_signal_wait(handle: Any) -> None:
    wait_for(lambda: handle.refresh().record.waiting_for == "signal:go", timeout=60, what=f"run {handle.run_id} to wait for go")


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "off"])
def test_a_run_that_parks_signals_and_takes_step_slots_opens_no_connection(worker_processes: WorkerProcesses, keep: bool) -> None:
    """Suspending, waking (the sleep's wake-up task too), consuming a signal and taking and
    giving back a step slot are durable's ORM statements: inside a worker's execution they
    run on the connection its thread keeps, so a run that does all of them makes the worker
    open no connection. With the setting off, every task that makes one opens a new backend."""
    env = {**LOGGED, "DURABLE_KEEP_WORKER_CONNECTION": "1" if keep else "0"}
    ready(worker_processes, "waiting", env=env)
    run_some(1, "warm")  # the thread's kept connection is open from here
    before = settled_sessions()

    handles = [engine.start("test.waiting", {"a": i, "key": "kept-slot"}) for i in range(3)]
    for i, handle in enumerate(handles):
        wait_for_signal_wait(handle)
        handle.signal("go", {"b": 10})
        assert handle.result(timeout=60) == {"total": i + 1 + 10}

    opened = settled_sessions() - before
    if keep:
        assert opened == 0
    else:
        # Per run: the park of the sleep, its wake-up, the park of the signal wait, the
        # execution that consumes the signal and takes the slot.
        assert opened >= 4 * len(handles)


def test_a_worker_shutting_down_closes_the_connections_its_threads_keep() -> None:
    """``worker_shutdown`` (and a prefork child's ``worker_process_shutdown``) closes
    the kept connections of threads that are still alive, as a pool's are then."""
    from celery.signals import worker_process_shutdown, worker_shutdown

    for signal_sent in (worker_shutdown, worker_process_shutdown):
        handle = engine.start("test.add", {"a": 1, "b": 2, "key": "shutdown"})
        executed, stop = threading.Event(), threading.Event()

        def pool_thread(run_id: str = handle.run_id, executed: threading.Event = executed, stop: threading.Event = stop) -> None:
            with engine.store.keep_connection():
                engine.executor.execute(run_id)
            executed.set()
            stop.wait(30)  # alive, its kept connection open, until the end of the test

        thread = threading.Thread(target=pool_thread)
        thread.start()
        try:
            assert executed.wait(30)
            assert handle.refresh().status == RunStatus.COMPLETED
            assert len(lifecycle_backends()) == 1

            signal_sent.send(sender=None)

            wait_for(lambda: lifecycle_backends() == [], timeout=10, what="the kept connection to close")
        finally:
            stop.set()
            thread.join()
