"""The advice a worker logs as it comes up when Celery's handling of Django's
connections makes every run pay a new PostgreSQL connection
(``durable.tasks.connection_advice``): the rules on the test database, then real
worker processes (prefork and threads) with Django's connection pool."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.thread import TaskPool as ThreadPool
from django.db import connection

from durable.tasks import connection_advice
from durable.testing import wait_for
from testproject.celery import app as celery_app

WARNING_START = "Celery closes the connection pool of DATABASES['default'] in each prefork child"
INFO_START = "Celery closes the connection to DATABASES['default'] before and after every task and it has no pool"


@pytest.fixture
def pool_option(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set OPTIONS['pool'] of the default connection for the test (read, never connected with)."""
    options = dict(connection.settings_dict.get("OPTIONS") or {})
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)

    def set_pool(value: Any) -> None:
        if value is None:
            options.pop("pool", None)
        else:
            options["pool"] = value

    return set_pool


@pytest.mark.postgres
@pytest.mark.parametrize("pool_cls", [PreforkPool, "prefork", "celery.concurrency.prefork:TaskPool"])
def test_a_prefork_worker_with_django_s_pool_is_warned(pool_option: Any, pool_cls: Any) -> None:
    pool_option(True)

    level, message = connection_advice(pool_cls, celery_app) or (None, "")

    assert level == logging.WARNING
    assert message.startswith(WARNING_START)
    assert "--pool=threads" in message


@pytest.mark.postgres
@pytest.mark.parametrize("pool_cls", [PreforkPool, ThreadPool, "solo"])
def test_a_worker_without_a_pool_is_told_every_run_opens_a_connection(pool_option: Any, pool_cls: Any) -> None:
    pool_option(None)

    level, message = connection_advice(pool_cls, celery_app) or (None, "")

    assert level == logging.INFO
    assert message.startswith(INFO_START)


@pytest.mark.postgres
@pytest.mark.parametrize("pool_cls", [ThreadPool, "threads", "solo", "gevent"])
def test_a_pool_kept_from_task_to_task_needs_no_advice(pool_option: Any, pool_cls: Any) -> None:
    pool_option({"min_size": 2})

    assert connection_advice(pool_cls, celery_app) is None


@pytest.mark.postgres
@pytest.mark.parametrize("pool", [None, True])
def test_celery_s_db_reuse_max_keeps_the_connections_so_nothing_is_said(
    pool_option: Any, pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool_option(pool)
    assert connection_advice(PreforkPool, celery_app) is not None
    monkeypatch.setitem(celery_app.conf, "CELERY_DB_REUSE_MAX", 100)

    assert connection_advice(PreforkPool, celery_app) is None


def test_nothing_is_said_off_postgresql() -> None:
    if connection.vendor == "postgresql":
        pytest.skip("the SQLite run checks this")

    assert connection_advice(PreforkPool, celery_app) is None


@pytest.mark.worker
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_prefork_worker_with_the_pool_logs_the_warning_and_a_threads_worker_does_not(worker_processes: Any) -> None:
    # The test project logs durable's warnings only; the advice is for a worker whose
    # runs use Django's connection (with KEEP_WORKER_CONNECTION, durable keeps its own:
    # tests/integration/test_kept_connections.py).
    info = {"DURABLE_LOG_LEVEL": "INFO", "DURABLE_KEEP_WORKER_CONNECTION": "0"}
    pooled = {**info, "DATABASE_URL": worker_processes.env["DATABASE_URL"] + "?pool=true"}
    worker_processes.start("prefork", pool="prefork", concurrency=1, env=pooled)
    worker_processes.start("threads", pool="threads", concurrency=2, env=pooled)
    worker_processes.start("plain", pool="threads", concurrency=2, env=info)

    for name in ("prefork", "threads", "plain"):
        wait_for(lambda name=name: " ready." in worker_processes.log(name), timeout=60, what=f"worker {name} to be ready")

    assert WARNING_START in worker_processes.log("prefork")
    assert WARNING_START not in worker_processes.log("threads")
    assert INFO_START not in worker_processes.log("threads")
    assert INFO_START in worker_processes.log("plain")
