"""Thin Celery tasks (they take ids and call the engine) and the Celery dispatcher.

Messages are JSON, acknowledged late and requeued when the worker process dies,
so a crash never loses a run; the engine's compare-and-set claim makes a
duplicate delivery change nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery import Task, shared_task
from celery.signals import worker_ready
from kombu.exceptions import OperationalError

from durable.conf import settings
from durable.runtime import dispatch

if TYPE_CHECKING:
    from durable.runtime.engine import Engine
    from durable.stores.base import RunRecord

logger = logging.getLogger(__name__)

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

    if engine.executor.execute(run_id):
        raise self.retry(countdown=redelivery_delay(self.request.retries))


def redelivery_delay(retries: int) -> float:
    """Seconds before an interrupted run's next delivery (its ``retries``-th)."""
    return min(float(settings.STALE_AFTER), float(settings.HEARTBEAT_INTERVAL) * 2 ** min(retries, 16))


@shared_task(name=WAKE_TASK, **_TASK_OPTIONS)
def wake_run(run_id: str) -> None:
    """The timer of a sleep or a signal timeout (a late or repeated one does nothing)."""
    from durable import engine

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


def task_id(run_id: str, generation: int) -> str:
    """The Celery task id of a run's messages: the same for every message of one generation."""
    return f"{run_id}:{generation}"


def _queue(queue: str = "") -> dict[str, Any]:
    chosen = queue or settings.TASK_QUEUE
    return {"queue": chosen} if chosen else {}


#: How ``send_run`` and ``send_wake`` publish: one quick retry (a pooled
#: connection gone stale after a broker restart reconnects), then give up, so a
#: start never hangs on a dead broker (Celery's default retries longer). How long
#: one connection attempt may take is the broker's setting (see the settings reference).
SEND_RETRY_POLICY: dict[str, Any] = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}


def send_run(run_id: str, *, task_id: str, queue: str = "") -> bool:
    """Send one run to the workers (called on commit). ``queue``: a remote workflow's queue.

    Never raises: the run is committed already, and a run whose message is lost
    stays ``pending`` until the sweeper sends it again (``REDISPATCH_AFTER``).
    A failed send is logged; returns whether the broker took the message.
    """
    try:
        execute_run.apply_async(
            args=(run_id,), task_id=task_id, serializer="json", retry_policy=SEND_RETRY_POLICY, **_queue(queue)
        )
    except Exception as exc:
        logger.error(
            "Could not send run %s to the broker (%s: %s). The run is saved as pending; "
            "the sweeper sends it again after REDISPATCH_AFTER (%ss).",
            run_id,
            type(exc).__name__,
            exc,
            settings.REDISPATCH_AFTER,
            exc_info=_traceback(exc),
        )
        return False
    return True


def send_wake(run_id: str, *, eta: datetime, queue: str = "") -> bool:
    """Ask a worker to wake the run at ``eta``.

    Only a fast path: Redis may deliver a long ETA twice (after its visibility
    timeout), and a lost one is covered by the sweeper, which wakes due runs
    from the database. So a failed send is logged, never raised.
    """
    try:
        wake_run.apply_async(args=(run_id,), eta=eta, serializer="json", retry_policy=SEND_RETRY_POLICY, **_queue(queue))
    except Exception as exc:
        logger.error(
            "Could not send the timer of run %s to the broker (%s: %s); the sweeper wakes the run when it is due.",
            run_id,
            type(exc).__name__,
            exc,
            exc_info=_traceback(exc),
        )
        return False
    return True


def revoke(task_id: str) -> bool:
    """Ask the workers to drop the messages of a cancelled run they have not started.

    Best effort, never raises: a message that still arrives finds the run
    cancelled and does nothing. A failed revoke is logged.
    """
    try:
        execute_run.app.control.revoke(task_id)
    except Exception as exc:
        logger.error(
            "Could not revoke the messages of run %s (task %s) on the broker (%s: %s); the run is cancelled, "
            "and a message that still arrives does nothing.",
            task_id.rpartition(":")[0],
            task_id,
            type(exc).__name__,
            exc,
            exc_info=_traceback(exc),
        )
        return False
    return True


def _traceback(exc: BaseException) -> bool:
    """Whether a failed send deserves a traceback: not for the broker being unreachable."""
    return not isinstance(exc, (OperationalError, OSError))


def live_queues(timeout: float = 1.0) -> list[str]:
    """The queues that live Celery workers consume (asks them; waits ``timeout`` seconds)."""
    replies = execute_run.app.control.inspect(timeout=timeout).active_queues() or {}
    return sorted({queue["name"] for queues in replies.values() for queue in queues})


class CeleryDispatcher(dispatch.Dispatcher):
    """Send the run's id to a Celery worker once the current transaction commits.

    The task id is ``<run id>:<generation>``, so cancelling a run can revoke its
    messages (those not yet started are dropped) without touching a later retry's.
    Sends and revokes run after the commit, so they never raise: a failure is
    logged and a run left ``pending`` is sent again by the sweeper.
    """

    def send(self, engine: Engine, run: RunRecord) -> None:
        run_id, queue = run.run_id, run.queue
        message_id = task_id(run.run_id, run.generation)
        engine.store.on_commit(lambda: send_run(run_id, task_id=message_id, queue=queue))

    def revoke(self, engine: Engine, run: RunRecord) -> None:
        message_id = task_id(run.run_id, run.generation)
        engine.store.on_commit(lambda: revoke(message_id))

    def wake_later(self, engine: Engine, run: RunRecord, eta: datetime) -> None:
        send_wake(run.run_id, eta=eta, queue=run.queue)

    def live_queues(self) -> list[str]:
        return live_queues()


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


def beat_schedule() -> dict[str, dict[str, Any]]:
    """The periodic sweep, to merge into ``app.conf.beat_schedule``::

    app.conf.beat_schedule = {**durable.tasks.beat_schedule(), ...}
    """
    entry: dict[str, Any] = {"task": SWEEP_TASK, "schedule": float(settings.SWEEP_INTERVAL)}
    if settings.TASK_QUEUE:
        entry["options"] = {"queue": settings.TASK_QUEUE}
    return {"durable-sweep": entry}
