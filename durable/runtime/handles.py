"""What the engine hands out: ``RunHandle``, a reference to one run, and
``EmitResult``, what ``engine.emit`` did."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async

from durable import exceptions
from durable.status import TERMINAL_STATUSES, RunStatus
from durable.stores.base import RunRecord

if TYPE_CHECKING:
    from durable.runtime.engine import Engine

#: ``engine.emit``'s warnings keep the engine's logger.
logger = logging.getLogger("durable.runtime.engine")


class RunHandle:
    """A reference to one run. ``status`` is as of the last read; ``refresh()`` reads again."""

    def __init__(self, engine: Engine, record: RunRecord, *, created: bool = False) -> None:
        self._engine = engine
        self._record = record
        #: True when the call that returned this handle created the run (False for an
        #: idempotent re-start of an existing run id, or a read).
        self.created = created

    def __repr__(self) -> str:
        return f"<RunHandle {self.workflow} {self.run_id} {self.status}>"

    run_id = property(lambda self: self._record.run_id)
    workflow = property(lambda self: self._record.workflow)
    version = property(lambda self: self._record.version)
    namespace = property(lambda self: self._record.namespace)
    status = property(lambda self: self._record.status)
    input = property(lambda self: self._record.input)
    output = property(lambda self: self._record.output)
    error = property(lambda self: self._record.error)
    record = property(lambda self: self._record)

    def refresh(self) -> RunHandle:
        self._record = self._engine._load(self.run_id)
        return self

    async def arefresh(self) -> RunHandle:
        self._record = await sync_to_async(self._engine._load)(self.run_id)
        return self

    def result(self, timeout: float | None = None) -> Any:
        """Wait for a terminal status; return the output or raise ``RunFailedError``."""
        polls = _Polls(self, timeout)
        while self.refresh().status not in TERMINAL_STATUSES:
            time.sleep(polls.next_wait())
        return self._outcome()

    async def aresult(self, timeout: float | None = None) -> Any:
        """``result`` for async code: it polls without blocking the event loop."""
        polls = _Polls(self, timeout)
        while (await self.arefresh()).status not in TERMINAL_STATUSES:
            await asyncio.sleep(polls.next_wait())
        return self._outcome()

    def _outcome(self) -> Any:
        """The output of a finished run, or ``RunFailedError``."""
        if self.status == RunStatus.COMPLETED:
            return self.output
        message = (self.error or {}).get("message", "") if isinstance(self.error, dict) else ""
        raise exceptions.RunFailedError(
            f"Run {self.run_id!r} ended {self.status}" + (f": {message}" if message else "."),
            run_id=self.run_id,
            status=self.status,
            error=self.error,
        )

    def cancel(self) -> RunHandle:
        self._record = self._engine.cancel(self.run_id)._record
        return self

    def signal(self, name: str, payload: Any = None) -> RunHandle:
        self._record = self._engine.signal(self.run_id, name, payload)._record
        return self


class _Polls:
    """The waits between two reads of a run that ``result`` waits for: from 10 ms,
    doubling up to 250 ms, never past the deadline (``TimeoutError`` once it passed)."""

    def __init__(self, handle: RunHandle, timeout: float | None) -> None:
        self.handle, self.timeout = handle, timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.delay = 0.01

    def next_wait(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, 0.25)
        if self.deadline is None:
            return delay
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"Run {self.handle.run_id!r} is still {self.handle.status} after {self.timeout}s.")
        return min(delay, left)


@dataclass
class SkippedSubscriber:
    workflow: str
    error: Exception


@dataclass
class EmitResult:
    """What ``engine.emit`` did: runs started, runs that existed already for this
    event id (not started twice), and subscribers skipped with the reason."""

    event: str
    event_id: str | None
    started: list[RunHandle] = field(default_factory=list)
    duplicates: list[RunHandle] = field(default_factory=list)
    skipped: list[SkippedSubscriber] = field(default_factory=list)

    @classmethod
    def of(cls, event: Any, event_id: Any) -> EmitResult:
        """An empty result, once the event's name and id are checked."""
        if not isinstance(event, str) or not event:
            raise exceptions.InvalidStartError(f"An event name must be a non-empty string, got {event!r}.")
        if event_id is not None and (not isinstance(event_id, str) or not event_id):
            raise exceptions.InvalidStartError(f"An event id must be a non-empty string, got {event_id!r}.")
        return cls(event=event, event_id=event_id)

    def run_id(self, workflow: str) -> str | None:
        """The run id of subscriber ``workflow``: one per event id, None without one."""
        return None if self.event_id is None else f"event:{self.event_id}:{workflow}"

    def add(self, handle: RunHandle) -> None:
        (self.started if handle.created else self.duplicates).append(handle)

    def skip(self, workflow: str, exc: exceptions.DurableError) -> None:
        logger.warning("Event %s (%s) skipped subscriber %s: %s", self.event, self.event_id, workflow, exc)
        self.skipped.append(SkippedSubscriber(workflow, exc))
