"""Threads on database connections of their own, for the tests that race or hold
transactions open on PostgreSQL (each thread's connection is closed when it ends)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connections, transaction


class DbThread(threading.Thread):
    """Runs ``target()`` on a connection of its own and keeps what it returned or raised."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._call = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._call()
        except BaseException as exc:  # noqa: BLE001  (outcome() raises it in the test)
            self.error = exc
        finally:
            connections.close_all()

    def outcome(self, timeout: float = 60) -> Any:
        """Wait for the thread; raise what ``target`` raised, else return what it returned."""
        self.join(timeout)
        assert not self.is_alive(), f"the thread did not end within {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


def started(target: Callable[[], Any]) -> DbThread:
    thread = DbThread(target)
    thread.start()
    return thread


@contextmanager
def held_open(target: Callable[[], Any]) -> Iterator[DbThread]:
    """Run ``target()`` inside a transaction in a thread of its own and keep that
    transaction open (uncommitted, its locks held) for the body of the ``with``;
    it commits when the body ends. ``outcome()`` of the yielded thread then gives
    what ``target`` returned."""
    ready, release = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def hold() -> Any:
        try:
            with transaction.atomic():
                result = target()
                ready.set()
                assert release.wait(60), "the test never released the transaction"
                return result
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            ready.set()

    thread = started(hold)
    try:
        assert ready.wait(30), "the held transaction did not start"
        if failed:
            raise failed[0]
        yield thread
    finally:
        release.set()
        thread.join(60)
