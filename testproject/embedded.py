"""An in-process Celery worker for the embedded default (memory transport, no services)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from celery import Celery
from celery.worker import WorkController


@contextmanager
def embedded_worker(app: Celery, *, concurrency: int = 10, timeout: float = 30.0) -> Iterator[WorkController]:
    """Run a thread-pool Celery worker in this process until the block exits."""
    ready = threading.Event()
    worker = WorkController(
        app=app,
        pool="threads",
        concurrency=concurrency,
        loglevel="WARNING",
        ready_callback=lambda consumer: ready.set(),
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
    )
    thread = threading.Thread(target=worker.start, name="celery-embedded", daemon=True)
    thread.start()
    if not ready.wait(timeout):
        raise RuntimeError(f"the embedded Celery worker did not start within {timeout}s")
    try:
        yield worker
    finally:
        worker.stop(in_sighandler=False)
        thread.join(timeout)
