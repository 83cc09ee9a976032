"""What a start, a cancel and a timer send to the workers: the Celery dispatcher of the
default engine, and the sends it makes after the commit (a start's message through the
background publisher, ``durable.tasks.publishing``; a timer and a revoke on the caller's
thread). None raises: a failed send is logged, and the sweeper covers a run left ``pending``.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING

from durable.conf import settings
from durable.runtime import dispatch
from durable.tasks.publishing import SEND_RETRY_POLICY, app_conf, publisher, queue_options, wants_traceback
from durable.tasks.workers import execute_run, wake_run

if TYPE_CHECKING:
    from durable.runtime.engine import Engine
    from durable.stores.base import RunRecord

logger = logging.getLogger("durable.tasks")  # the package's logger, as documented


def task_id(run_id: str, generation: int) -> str:
    """The Celery task id of a run's messages: the same for every message of one generation."""
    return f"{run_id}:{generation}"


def send_run(run_id: str, *, task_id: str, queue: str = "") -> bool:
    """Send one run to the workers (called on commit). ``queue``: a remote workflow's queue.

    Never raises: the run is committed already, and a run whose message is lost
    stays ``pending`` until the sweeper sends it again (``REDISPATCH_AFTER``).
    A failed send is logged; returns whether the broker took the message.
    """
    try:
        execute_run.apply_async(
            args=(run_id,), task_id=task_id, serializer="json", retry_policy=SEND_RETRY_POLICY, **queue_options(queue)
        )
    except Exception as exc:
        logger.error(
            "Could not send run %s to the broker (%s: %s). The run is saved as pending; "
            "the sweeper sends it again after REDISPATCH_AFTER (%ss).",
            run_id,
            type(exc).__name__,
            exc,
            settings.REDISPATCH_AFTER,
            exc_info=wants_traceback(exc),
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
        wake_run.apply_async(args=(run_id,), eta=eta, serializer="json", retry_policy=SEND_RETRY_POLICY, **queue_options(queue))
    except Exception as exc:
        logger.error(
            "Could not send the timer of run %s to the broker (%s: %s); the sweeper wakes the run when it is due.",
            run_id,
            type(exc).__name__,
            exc,
            exc_info=wants_traceback(exc),
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
            exc_info=wants_traceback(exc),
        )
        return False
    return True


def publish_run(run_id: str, *, task_id: str, queue: str = "") -> None:
    """The on-commit send of a run: handed to the background ``publisher``, or sent at once
    with ``send_run`` when Celery runs tasks eagerly (``task_always_eager``: the run executes
    before the call returns, as ``apply_async`` would) or ``PUBLISH_IN_BACKGROUND`` is off."""
    app = execute_run.app
    # Celery's own order: a value set on app.conf wins over the settings it was configured from.
    eager = app.conf.changes.get("task_always_eager", None)
    if eager is None:
        eager = app_conf(app).eager
    if eager or not settings.PUBLISH_IN_BACKGROUND:
        send_run(run_id, task_id=task_id, queue=queue)
        return
    publisher.submit(app, run_id, task_id, queue or settings.TASK_QUEUE or None)


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
        engine.store.on_commit(lambda: publish_run(run_id, task_id=message_id, queue=queue))

    def revoke(self, engine: Engine, run: RunRecord) -> None:
        message_id = task_id(run.run_id, run.generation)
        engine.store.on_commit(lambda: revoke(message_id))

    def wake_later(self, engine: Engine, run: RunRecord, eta: datetime) -> None:
        send_wake(run.run_id, eta=eta, queue=run.queue)

    def live_queues(self) -> list[str]:
        return live_queues()
