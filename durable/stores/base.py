"""The store protocol: everything the engine needs from persistence.

``DjangoStore`` (the default) and ``InMemoryStore`` implement it. A custom store
may leave out ``count_runs``: the engine then counts with ``len(list_runs(...))``;
and ``run_exists`` (whether a run has an id, once a start of that id not yet
committed has ended): the engine then uses ``get_run``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from durable.concurrency import Quota


class RunExists(Exception):
    """Raised by ``create_run`` (or when leaving ``admission``) for a run id taken already."""


@dataclass
class RunRecord:
    run_id: str
    workflow: str
    version: str
    namespace: str
    status: str
    input: Any = None
    output: Any = None
    error: Any = None
    attempt: int = 0
    generation: int = 0
    parent_run_id: str | None = None
    queue: str = ""
    waiting_for: str = ""
    wake_at: datetime | None = None
    lease: str = ""
    worker: str = ""
    created_at: datetime | None = None
    updated_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    heartbeat_at: datetime | None = None
    dispatched_at: datetime | None = None
    redispatches: int = 0
    tags: list[str] = field(default_factory=list)
    #: The start counted its quotas in ``namespace`` only (``scope_reads``); its children count so too.
    fenced: bool = False


@dataclass(frozen=True)
class StepEntry:
    position: int
    name: str
    outcome: str  # "completed" | "failed"
    output: Any = None
    error: Any = None
    attempts: int = 1
    started_at: datetime | None = None


@runtime_checkable
class Store(Protocol):
    # -- reads -------------------------------------------------------------
    def get_run(self, run_id: str) -> RunRecord | None: ...

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> list[RunRecord]: ...

    # -- admission ---------------------------------------------------------
    def admission(self, quotas: Sequence[Quota]) -> AbstractContextManager[None]:
        """One transaction holding the lock of every quota's key (in key order)."""
        ...

    def create_run(self, record: RunRecord, tags: Sequence[str]) -> None:
        """Insert the run (with the status, error and times of ``record``) and its tags."""
        ...

    def on_commit(self, fn: Callable[[], object]) -> None: ...

    # -- state changes (compare-and-set) -----------------------------------
    def transition(
        self,
        run_id: str,
        *,
        from_statuses: Sequence[str],
        to: str,
        expect: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> bool:
        """Compare-and-set: move the run to ``to`` (setting ``fields``) only if its
        status is in ``from_statuses`` and its fields equal ``expect``."""
        ...

    def claim(
        self, run_id: str, *, lease: str, worker: str, stale_before: datetime
    ) -> RunRecord | None: ...

    def heartbeat(self, run_id: str, lease: str) -> bool: ...

    def finish(
        self, run_id: str, lease: str, *, status: str, output: Any = None, error: Any = None
    ) -> bool: ...

    def retry(self, run_id: str, *, from_statuses: Sequence[str], tags: Sequence[str]) -> bool:
        """Compare-and-set the run back to ``pending`` with ``tags``, dropping its failed steps."""
        ...

    # -- journal -------------------------------------------------------------
    def load_steps(self, run_id: str) -> list[StepEntry]: ...

    def record_step(self, run_id: str, lease: str, step: StepEntry) -> bool:
        """Journal ``step`` (replacing a ``waiting`` entry at its position); False when
        the run no longer belongs to ``lease``."""
        ...

    # -- waiting -----------------------------------------------------------------
    def suspend(self, run_id: str, lease: str, *, waiting_for: str, wake_at: datetime | None) -> bool:
        """Park the run ``suspended``, unless what it waits for (a buffered signal, a
        finished child) is already there: then return False and leave it running."""
        ...

    def add_signal(self, run_id: str, name: str, payload: Any) -> RunRecord | None:
        """Buffer a signal for the run (holding its row, so a concurrent ``suspend``
        sees it); the run as it was, or None when there is no such run."""
        ...

    def consume_signal(self, run_id: str, lease: str, name: str, step: StepEntry) -> tuple[bool, Any]:
        """Take the oldest buffered signal ``name`` and journal ``step`` with its payload, atomically."""
        ...

    def active_children(self, run_id: str) -> list[RunRecord]: ...

    def due_runs(self, now: datetime) -> list[RunRecord]:
        """Suspended runs whose ``wake_at`` has come."""
        ...

    def waiting_parents(self) -> list[RunRecord]:
        """Suspended runs waiting for a child that has ended (its wake-up was lost)."""
        ...

    def runs_on_queues(self, statuses: Sequence[str]) -> list[RunRecord]:
        """Runs in ``statuses`` whose messages go to a queue of their own (remote workflows)."""
        ...

    # -- strategies ------------------------------------------------------------
    def run_keys(self, run_id: str) -> list[str]:
        """The concurrency keys of a run (its ``concurrency:`` tags, without the prefix)."""
        ...

    def quota_settings(self, keys: Sequence[str]) -> dict[str, tuple[int | None, tuple[str, ...]]]:
        """The last ``(limit, count_statuses)`` a start used for each key."""
        ...

    def queued_heads(self, tag: str, *, namespace: str | None = None) -> list[tuple[str, str]]:
        """``(group, run_id)`` of the oldest queued run of each group queued on ``tag``."""
        ...

    def rr_cursor(self, key: str) -> str: ...

    def set_rr_cursor(self, key: str, group: str) -> None: ...

    def keys_with_queued(self) -> dict[str, list[str]]:
        """The keys that have queued runs, by the namespace of those runs."""
        ...

    # -- recovery ------------------------------------------------------------
    def orphaned_runs(self, heartbeat_before: datetime, dispatched_before: Sequence[datetime] = ()) -> list[RunRecord]:
        """Running runs whose heartbeat is older than ``heartbeat_before``; when
        ``dispatched_before`` is given, only those not re-sent since their claim or
        whose last re-send is due for another (see ``undelivered_runs``)."""
        ...

    def undelivered_runs(self, dispatched_before: Sequence[datetime]) -> list[RunRecord]:
        """Pending runs due for a re-send: a run re-sent ``n`` times already is due
        when its last message was sent before ``dispatched_before[n]`` (the last
        cutoff for any larger ``n``); see ``redispatch_cutoffs``."""
        ...

    def mark_dispatched(self, run_ids: Sequence[str]) -> None:
        """The sweeper re-sent these runs now: set ``dispatched_at``, count the re-send."""
        ...


#: The sweeper's re-sends of one run wait ``REDISPATCH_AFTER * 2**n`` after the
#: previous message, with ``n`` at most this (64 times ``REDISPATCH_AFTER``).
REDISPATCH_BACKOFF_CAP = 6


def redispatch_cutoffs(now: datetime, redispatch_after: float) -> list[datetime]:
    """For ``n`` = 0 .. ``REDISPATCH_BACKOFF_CAP``: a run re-sent ``n`` times is due
    again when its last message is older than the ``n``-th datetime."""
    return [now - timedelta(seconds=redispatch_after * 2**n) for n in range(REDISPATCH_BACKOFF_CAP + 1)]


def group_keys(tags: Sequence[str]) -> dict[str, str]:
    """For each tag, the group of its run for round-robin hand-off: the run's other tags."""
    return {tag: "|".join(sorted(t for t in tags if t != tag)) for tag in tags}
