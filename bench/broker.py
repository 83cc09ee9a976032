"""The benchmark's Redis broker, seen from the parent: reach it, measure and empty its queues."""

from __future__ import annotations

from typing import Any


def broker_app(broker: str) -> Any:
    """A Celery app on ``broker`` (JSON only), not the current app; close it when done."""
    from celery import Celery

    app = Celery("durable-bench", broker=broker, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=False)
    return app


def reach(app: Any) -> str:
    """Why the broker cannot be used ("" when it can)."""
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=5)
    except Exception as exc:
        return f"cannot reach the broker ({type(exc).__name__}: {exc}); start Redis or pass --broker redis://host:port/db"
    return ""


def purge(app: Any, queue: str) -> None:
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue)


def queue_length(app: Any, queue: str) -> int:
    """Messages waiting in ``queue`` (a Redis list named after it)."""
    with app.connection_for_write() as conn:
        return int(conn.default_channel.client.llen(queue))


def delete_queue(app: Any, queue: str) -> None:
    """Remove the queue and its binding keys from Redis (declared as Celery declares a queue of that name)."""
    from kombu import Exchange, Queue

    try:
        with app.connection_for_write() as conn:
            declared = Queue(queue, Exchange(queue), routing_key=queue)(conn.default_channel)
            declared.declare()
            declared.delete()
    except Exception:  # best effort: what is left in Redis is a few small keys
        pass
