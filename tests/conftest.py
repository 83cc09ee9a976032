from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from celery.contrib.testing.worker import start_worker
from django.db import connections

from durable.stores import kept
from testproject.celery import app as celery_app
from tests import waiting, workflows  # noqa: F401  (registers the test workflows)
from tests.processes import WorkerProcesses


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from django.conf import settings

    if settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        return
    skip = pytest.mark.skip(reason="needs PostgreSQL: set DATABASE_URL")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None) -> Iterator[None]:
    """pytest-django's test databases, and before they are dropped, the connections of the
    thread ``sync_to_async`` ran the async tests' database work in (outside ``async_to_sync``
    it is one thread for the whole session, and nothing else closes its connections; left
    open, they made dropping the PostgreSQL test database fail)."""
    yield

    async def close_the_async_threads_connections() -> None:
        await sync_to_async(connections.close_all)()

    asyncio.run(close_the_async_threads_connections())


@pytest.fixture(scope="module")
def celery_worker(django_db_setup: None, django_db_blocker) -> Iterator[object]:
    """A real Celery worker (thread pool) in this process, consuming the test broker.

    One per test module that asks for it, stopped at the module's end: a worker left
    running for the session executed the runs that later modules' committing tests
    start and expect to find pending."""
    # Only the test project's own queue (durable-test), never another project's "celery".
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_purge(celery_app.conf.task_default_queue)
    with contextlib.ExitStack() as stack:
        # Celery's Django fixup runs the system checks as the worker starts; on
        # Django 6.1 the model checks read the database (its JSON support).
        with django_db_blocker.unblock():
            worker = stack.enter_context(
                start_worker(
                    celery_app,
                    pool="threads",
                    concurrency=4,
                    perform_ping_check=False,
                    shutdown_timeout=30,
                    loglevel="WARNING",
                )
            )
        yield worker
    # A real worker closes them as it shuts down (worker_shutdown); this in-process one
    # sends no such signal and leaves its pool's threads alive.
    kept.close_all()


@pytest.fixture
def worker_processes(settings: Any, tmp_path: Path) -> Iterator[WorkerProcesses]:
    """Real Celery worker subprocesses on a queue of the test's own (PostgreSQL + Redis)."""
    workers = WorkerProcesses(settings, tmp_path)
    yield workers
    workers.stop_all()


@pytest.fixture(autouse=True)
def _fast_recovery(settings) -> None:
    settings.DURABLE = {
        **getattr(settings, "DURABLE", {}),
        "HEARTBEAT_INTERVAL": 0.2,
        "STALE_AFTER": 2.0,
        "REDISPATCH_AFTER": 2.0,
    }
