"""What runs in a Celery worker: durable's tasks (they take ids and call the engine),
what a worker does as it comes up, and the periodic sweep's beat entry.

Messages are JSON, acknowledged late and requeued when the worker process dies,
so a crash never loses a run; the engine's compare-and-set claim makes a
duplicate delivery change nothing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from celery import Celery, Task, shared_task
from celery.signals import worker_process_shutdown, worker_ready, worker_shutdown
from kombu.utils.compat import detect_environment

from durable.conf import settings

logger = logging.getLogger("durable.tasks")  # the package's logger, as documented

#: The task that executes a run (the background publisher sends it by this name).
EXECUTE_TASK = "durable.execute_run"
WAKE_TASK = "durable.wake_run"
SWEEP_TASK = "durable.sweep"
#: What the ``PeriodicTask`` row of each persisted schedule sends (see ``durable.schedules``).
FIRE_SCHEDULE_TASK = "durable.fire_schedule"

_TASK_OPTIONS: dict[str, Any] = {"acks_late": True, "reject_on_worker_lost": True, "serializer": "json", "ignore_result": True}


@shared_task(name=EXECUTE_TASK, bind=True, max_retries=None, **_TASK_OPTIONS)
def execute_run(self: Task, run_id: str) -> None:
    """Execute the run; when an infrastructure error interrupted it (the run was
    handed back ``pending``), deliver it again after a delay growing with each such
    retry (``HEARTBEAT_INTERVAL * 2**n``, at most ``STALE_AFTER``). If that message
    cannot be sent, the sweeper re-sends the pending run."""
    from durable import engine

    with keeping_connection(engine):
        interrupted = engine.executor.execute(run_id)
    if interrupted:
        raise self.retry(countdown=redelivery_delay(self.request.retries))


def keeping_connection(engine: Any) -> contextlib.AbstractContextManager[None]:
    """Around a task of durable's: its statements run on the thread's kept connection
    when ``keeps_connection()`` (``BaseStore.keep_connection``), else on Django's."""
    return engine.store.keep_connection() if keeps_connection() else contextlib.nullcontext()


def keeps_connection() -> bool:
    """Whether this worker runs an execution's lifecycle statements on a connection it
    keeps across tasks (``KEEP_WORKER_CONNECTION``; see ``BaseStore.keep_connection``):
    not under eventlet or gevent, whose tasks each run in a green thread of their own."""
    return bool(settings.KEEP_WORKER_CONNECTION) and detect_environment() == "default"


def redelivery_delay(retries: int) -> float:
    """Seconds before an interrupted run's next delivery (its ``retries``-th)."""
    return min(float(settings.STALE_AFTER), float(settings.HEARTBEAT_INTERVAL) * 2 ** min(retries, 16))


@shared_task(name=WAKE_TASK, **_TASK_OPTIONS)
def wake_run(run_id: str) -> None:
    """The timer of a sleep or a signal timeout (a late or repeated one does nothing)."""
    from durable import engine

    with keeping_connection(engine):
        engine.executor.wake_due(run_id)


@shared_task(name=SWEEP_TASK, serializer="json", ignore_result=True)
def sweep() -> dict[str, list[str]]:
    from durable import engine

    return engine.sweep()


@shared_task(name=FIRE_SCHEDULE_TASK, acks_late=True, reject_on_worker_lost=True, serializer="json", ignore_result=True)
def fire_schedule(schedule_id: int) -> None:
    """Start the run of the schedule's current window (idempotent per window)."""
    from durable import schedules

    schedules.fire(int(schedule_id))


@worker_ready.connect
def _unblock_on_worker_start(sender: Any = None, **kwargs: Any) -> None:
    """A worker came up: runs blocked on the queues it consumes can go now."""
    try:
        queues = [q.name for q in sender.task_consumer.queues]
        from durable import engine

        # Only unblock: this worker knows its own queues, not which others are served.
        unblocked = engine.executor.check_remote_queues(live_queues=queues, block=False)[1]
        if unblocked:
            logger.info("Unblocked %d runs waiting for queues %s.", len(unblocked), ", ".join(queues))
    except Exception:  # a worker must start even if this fails: the sweeper covers it
        logger.exception("Could not unblock runs on worker start")


def connection_advice(pool_cls: Any, app: Celery, alias: str = "default") -> tuple[int, str] | None:
    """What a worker of ``pool_cls`` (its ``--pool``: a class or its name) should be told
    about its connections to ``alias`` on PostgreSQL, as (logging level, message); None
    when nothing. Celery's Django fix-up (``celery.fixups.django``) closes the Django
    connections before and after every task, and in a prefork child it also closes
    Django's connection pool; only its ``CELERY_DB_REUSE_MAX`` setting keeps them."""
    from django.db import connections

    connection = connections[alias]
    if connection.vendor != "postgresql" or app.conf.get("CELERY_DB_REUSE_MAX"):
        return None
    pool = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", "")
    pooled = bool((connection.settings_dict.get("OPTIONS") or {}).get("pool"))
    if pooled and "prefork" in pool:
        return logging.WARNING, (
            f"Celery closes the connection pool of DATABASES[{alias!r}] in each prefork child before and "
            "after every task: every run this worker executes opens a new pool and a new PostgreSQL "
            "connection, slower than without the pool. Run the worker with --pool=threads, or drop "
            "OPTIONS['pool'] and put PgBouncer in front of PostgreSQL."
        )
    if not pooled:
        return logging.INFO, (
            f"Celery closes the connection to DATABASES[{alias!r}] before and after every task and it has "
            "no pool: every run this worker executes opens a new PostgreSQL connection, whose first queries "
            "cost several milliseconds more than on a connection already used. That is cheap behind "
            "PgBouncer; otherwise give the worker OPTIONS['pool'] = True and --pool=threads."
        )
    return None


@worker_ready.connect
def _advise_on_connections(sender: Any = None, **kwargs: Any) -> None:
    """Say once, as a worker comes up, when every run it executes pays a new connection
    (not when it keeps its connections for durable's statements: ``keeps_connection``)."""
    try:
        if keeps_connection():
            return
        from durable import engine

        alias = getattr(engine.store, "using", None)  # a DjangoStore's database
        advice = None if alias is None else connection_advice(sender.controller.pool_cls, sender.app, alias)
    except Exception:  # advice only: a worker must start whatever happens here
        logger.debug("Could not check the worker's database connections", exc_info=True)
        return
    if advice is not None:
        logger.log(*advice)


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_kept_connections(**kwargs: Any) -> None:
    """The worker (or a prefork child) stops: close the connections its executions kept."""
    from durable.stores import kept

    kept.close_all()


def beat_schedule() -> dict[str, dict[str, Any]]:
    """The periodic sweep, to merge into ``app.conf.beat_schedule``::

    app.conf.beat_schedule = {**durable.tasks.beat_schedule(), ...}
    """
    entry: dict[str, Any] = {"task": SWEEP_TASK, "schedule": float(settings.SWEEP_INTERVAL)}
    if settings.TASK_QUEUE:
        entry["options"] = {"queue": settings.TASK_QUEUE}
    return {"durable-sweep": entry}
