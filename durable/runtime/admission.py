"""What a start gets when its keys are full (the strategies), and slot hand-off.

``decide`` runs inside the admission transaction, with every key of the start
locked: it counts and returns what to create. ``Promoter`` hands freed slots to
queued runs (``GROUP_ROUND_ROBIN``, ``CANCEL_QUEUED_EXCEPT_NEWEST`` / ``_OLDEST``),
round-robin across the groups queued on a key.
Both work on a ``Scope`` (the store, the namespace slots are counted in, and how
to send a run it started), not on the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from django.utils import timezone

from durable import conf, exceptions
from durable.concurrency import QUEUEING_STRATEGIES, TAG_PREFIX, Quota, Strategy
from durable.runtime import bursts
from durable.status import ACTIVE_STATUSES, TERMINAL_STATUSES, RunStatus
from durable.stores.base import BaseStore, RunRecord

logger = logging.getLogger(__name__)

#: How many hand-offs one release may make at most (a backstop, not a limit users meet).
MAX_HANDOFFS = 10_000


@dataclass(frozen=True)
class Scope:
    """What admission needs of an engine: its ``store``, the ``namespace`` its
    quotas count in (None: every namespace), and ``send``, which hands a run it
    made ``pending`` to the engine's dispatcher."""

    store: BaseStore
    namespace: str | None
    send: Callable[[RunRecord], None]

    def count(self, tag: str, statuses: Sequence[str]) -> int:
        """The runs tagged ``tag`` in ``statuses``: what a quota counts."""
        return int(self.store.count_runs(tag=tag, statuses=statuses, namespace=self.namespace))

    def retry_after(self, quota: Quota) -> int:
        """The ``Retry-After`` seconds of a refusal on ``quota``'s full key (only a refusal asks)."""
        return conf.retry_after_seconds(self.store.retry_estimate(quota, namespace=self.namespace))


@dataclass(frozen=True)
class Superseded:
    """A queued run that a ``CANCEL_QUEUED_EXCEPT_NEWEST`` start cancels: it leaves
    the queue of ``key`` to make room for the new run."""

    run: RunRecord
    key: str


@dataclass
class Decision:
    """The status the new run is created with, the in-flight runs to cancel for it
    (``victims``, CANCEL_IN_PROGRESS) and the queued ones (``superseded``,
    CANCEL_QUEUED_EXCEPT_NEWEST). A run created ``cancelled`` carries ``reason``
    as its error's message, under the error type ``cancel_type``, with ``details``
    as further fields of its error."""

    status: str = RunStatus.PENDING
    victims: list[RunRecord] = field(default_factory=list)
    reason: str = ""
    superseded: list[Superseded] = field(default_factory=list)
    cancel_type: str = "durable.cancel_newest"
    details: dict[str, str] = field(default_factory=dict)
    #: The tags of the pools the run borrows from, beyond its keys' (``bursts.decide``).
    borrowed: list[str] = field(default_factory=list)


def decide(scope: Scope, workflow: str, quotas: Sequence[Quota], *, ancestors: Sequence[RunRecord] = ()) -> Decision:
    """Count every key (they are locked) and apply the strategies of the full ones.

    A key is full when its runs in ``count_statuses`` reach its limit, or, for
    the queueing strategies (GROUP_ROUND_ROBIN, CANCEL_QUEUED_EXCEPT_NEWEST and
    _OLDEST), when runs are queued on it already: runs queued first go first.
    Precedence when several keys are full, first match wins:

    1. REJECT raises ``ConcurrencyLimitError`` (so does any key that can never
       make room, below);
    2. else CANCEL_NEWEST, or CANCEL_QUEUED_EXCEPT_OLDEST whose queue holds
       ``max_queued`` runs, creates the run ``cancelled`` (the queue is kept);
    3. else a queueing key queues it: GROUP_ROUND_ROBIN past its ``max_queued``
       raises ``ConcurrencyQueueFullError`` (nothing is cancelled), and each
       CANCEL_QUEUED_EXCEPT_NEWEST key whose queue holds ``max_queued`` runs has
       its oldest queued runs cancelled to make room (``superseded``);
    4. else every full key is CANCEL_IN_PROGRESS: the oldest in-flight runs of
       each are cancelled and the run starts.

    Every strategy rejects a key that can never make room: a limit of 0 or
    less, or a lifetime cap (``count_statuses`` naming a terminal status) whose
    finished runs alone fill it. ``ancestors`` (a child start's parent, its
    parent...) are never cancelled for it; a child is not queued on a full key
    one of its ancestors holds a slot of while it waits (``suspended`` counted):
    that ancestor could wait for it forever.
    """
    full: list[tuple[Quota, int, int]] = []
    borrowed: list[str] = []
    for quota in quotas:
        if quota.burst is not None:  # REJECT, as every key of such a start (concurrency.resolve)
            borrowed.extend(t for t in bursts.decide(scope, workflow, quota) if t not in borrowed)
            continue
        active = scope.count(quota.tag, quota.count_statuses)
        queued = 0
        if quota.strategy in QUEUEING_STRATEGIES:
            # Runs queued before this one go first: room is theirs.
            queued = scope.count(quota.tag, [RunStatus.QUEUED])
        if active >= quota.limit or queued:
            full.append((quota, active, queued))
        if quota.limit <= 0:
            raise exceptions.ConcurrencyLimitError(
                workflow=workflow, key=quota.key, limit=quota.limit, active=active, retry_after=conf.retry_after_seconds()
            )
        if quota.strategy is Strategy.REJECT and active >= quota.limit:
            raise exceptions.ConcurrencyLimitError(
                workflow=workflow, key=quota.key, limit=quota.limit, active=active, retry_after=scope.retry_after(quota)
            )
        finished = [s for s in quota.count_statuses if s in TERMINAL_STATUSES]
        if active >= quota.limit and finished and scope.count(quota.tag, finished) >= quota.limit:
            raise exceptions.ConcurrencyLimitError(
                workflow=workflow,
                key=quota.key,
                limit=quota.limit,
                active=active,
                hint=exceptions.LIFETIME_CAP_HINT,
                retry_after=conf.retry_after_seconds(),
            )
    if not full:
        return Decision(borrowed=borrowed)
    strategies = {quota.strategy for quota, _, _ in full}
    if Strategy.CANCEL_NEWEST in strategies:
        keys = ", ".join(q.key for q, _, _ in full if q.strategy is Strategy.CANCEL_NEWEST)
        return Decision(RunStatus.CANCELLED, reason=f"Cancelled at start: concurrency key {keys} was full (CANCEL_NEWEST).")
    for quota, active, queued in full:
        if quota.strategy is Strategy.CANCEL_QUEUED_EXCEPT_OLDEST and queued >= (quota.max_queued or 1):
            return Decision(
                RunStatus.CANCELLED,
                reason=f"Cancelled at start: the queue of concurrency key {quota.key} was full ({queued} of "
                f"max_queued={quota.max_queued} waiting, {active} of {quota.limit} in flight); "
                "CANCEL_QUEUED_EXCEPT_OLDEST keeps the runs queued first.",
                cancel_type="durable.cancel_queued_except_oldest",
                details={"key": quota.key},
            )
    if strategies & QUEUEING_STRATEGIES:
        superseded: dict[str, Superseded] = {}
        for quota, active, queued in full:
            if quota.strategy not in QUEUEING_STRATEGIES:
                continue
            if quota.strategy is Strategy.GROUP_ROUND_ROBIN and quota.max_queued is not None and queued >= quota.max_queued:
                raise exceptions.ConcurrencyQueueFullError(
                    workflow=workflow,
                    key=quota.key,
                    limit=quota.limit,
                    active=active,
                    queued=queued,
                    max_queued=quota.max_queued,
                    retry_after=scope.retry_after(quota),
                )
            holder = _holding_ancestor(scope.store, quota, ancestors) if active >= quota.limit else None
            if holder is not None:
                raise exceptions.ConcurrencyLimitError(
                    workflow=workflow,
                    key=quota.key,
                    limit=quota.limit,
                    active=active,
                    hint=exceptions.holding_ancestor_hint(holder),
                    retry_after=conf.retry_after_seconds(),
                )
            if quota.strategy is Strategy.CANCEL_QUEUED_EXCEPT_NEWEST and queued >= (quota.max_queued or 1):
                for run in _oldest_queued(scope, quota, queued - (quota.max_queued or 1) + 1):
                    superseded.setdefault(run.run_id, Superseded(run, quota.key))
        reason = ""
        if superseded:
            names = ", ".join(f"{s.run.run_id!r} (key {s.key})" for s in superseded.values())
            reason = f"Queued; it replaces the queued run(s) {names}, cancelled (CANCEL_QUEUED_EXCEPT_NEWEST)."
        return Decision(RunStatus.QUEUED, superseded=list(superseded.values()), reason=reason)
    victims: dict[str, RunRecord] = {}
    spared = {a.run_id for a in ancestors}
    for quota, active, _ in full:  # every one is CANCEL_IN_PROGRESS
        # Only runs that can be cancelled (not finished ones of a lifetime cap),
        # never an ancestor of this start; none if cancelled runs count too.
        statuses = [s for s in quota.count_statuses if s in ACTIVE_STATUSES]
        in_flight: list[RunRecord] = []
        if RunStatus.CANCELLED not in quota.count_statuses:
            in_flight = scope.store.list_runs(tag=quota.tag, statuses=statuses, namespace=scope.namespace)
            in_flight = [r for r in in_flight if r.run_id not in spared]
        in_flight.sort(key=lambda r: (r.created_at or timezone.now(), r.run_id))
        needed = active - quota.limit + 1
        if len(in_flight) < needed:
            raise exceptions.ConcurrencyLimitError(
                workflow=workflow,
                key=quota.key,
                limit=quota.limit,
                active=active,
                hint="Cancelling the runs that may be cancelled for it (not finished runs, not its own "
                "ancestors) cannot make room.",
                retry_after=conf.retry_after_seconds(),
            )
        for run in in_flight[:needed]:
            victims.setdefault(run.run_id, run)
    return Decision(victims=list(victims.values()))


def check_room(scope: Scope, workflow: str, quotas: Sequence[Quota], new_status: str) -> None:
    """After a start created its run with ``new_status`` (its keys locked): raise
    ``ConcurrencyLimitError`` for the first key that the new run takes over its limit."""
    for quota in quotas:
        active = scope.count(quota.tag, quota.count_statuses)
        if new_status in quota.count_statuses:
            active -= 1  # the other runs
        if active >= quota.limit:
            raise exceptions.ConcurrencyLimitError(
                workflow=workflow, key=quota.key, limit=quota.limit, active=active, retry_after=scope.retry_after(quota)
            )


def _oldest_queued(scope: Scope, quota: Quota, n: int) -> list[RunRecord]:
    """The ``n`` runs queued on ``quota``'s key first (by creation, then run id)."""
    queued = scope.store.list_runs(tag=quota.tag, statuses=[RunStatus.QUEUED], namespace=scope.namespace)
    queued.sort(key=lambda r: (r.created_at or timezone.now(), r.run_id))
    return queued[:n]


def _holding_ancestor(store: BaseStore, quota: Quota, ancestors: Sequence[RunRecord]) -> str | None:
    """The first of ``ancestors`` that holds a slot of ``quota``'s key while it
    waits for its children (``suspended`` is counted), or None."""
    if RunStatus.SUSPENDED not in quota.count_statuses:
        return None  # a parent waiting for its child frees its slot
    for ancestor in ancestors:
        if ancestor.status in quota.count_statuses and quota.key in store.run_keys(ancestor.run_id):
            return ancestor.run_id
    return None


class Promoter:
    """Hands the free slots of keys to their queued runs."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    def promote(self, keys: Sequence[str] = (), *, run_id: str | None = None) -> list[str]:
        """Start queued runs of ``keys`` (then of the keys of ``run_id``, a run that
        left its slots) while those keys have room; return the run ids started.

        A key is left as soon as a hand-off took its last free slot: a slot that
        frees later is handed on by the promote of the run that frees it (every
        release promotes on commit), so looking again would only find it full.

        A store that promotes in one go (``BaseStore.promote``: PostgreSQL's
        ``durable_promote``) does it all; the runs it started are sent here.
        """
        store = self.scope.store
        records = store.promote(keys, run_id=run_id, count_namespace=self.scope.namespace)
        if records is not None:
            return self.send(records)
        if run_id is not None:
            keys = [*keys, *store.run_keys(run_id)]
        started: list[str] = []
        for key in dict.fromkeys(keys):
            for _ in range(MAX_HANDOFFS):
                run_id, room_left = self._hand_off(key)
                if run_id is None:
                    break
                started.append(run_id)
                if not room_left:
                    break
        return started

    def send(self, records: Sequence[RunRecord]) -> list[str]:
        """Send the runs a promote made pending (handed a slot); their run ids."""
        for record in records:
            self.scope.send(record)
            logger.debug("Handed a slot to queued run %s.", record.run_id)
        return [record.run_id for record in records]

    def _hand_off(self, key: str) -> tuple[str | None, bool]:
        """Start the next queued run of ``key`` in round-robin order of its groups.

        Returns the run started (None if none could be) and whether ``key`` may
        still have a free slot after it. A head that another promoter started
        (or that was cancelled) since it was read means the queue moved: read
        the heads again, or the slot freed by this promoter's release would stay
        free while runs wait.
        """
        store = self.scope.store
        for _ in range(MAX_HANDOFFS):
            heads = store.queued_heads(TAG_PREFIX + key, namespace=self.scope.namespace)
            if not heads:
                return None, False
            known = store.quota_settings([key])
            if self._full(key, known):
                return None, False
            cursor = store.rr_cursor(key) if len(heads) > 1 else ""  # one group: no order to keep
            # The groups after the one served last, then the others from the start.
            ordered = [h for h in heads if h[0] > cursor] + [h for h in heads if h[0] <= cursor]
            gone = False
            for group, run_id in ordered:
                outcome = self._try_start(key, group, run_id, known)
                if outcome in ("started", "filled"):
                    return run_id, outcome == "started"
                if outcome == "key full":
                    return None, False
                gone = gone or outcome == "gone"
            if not gone:
                return None, False  # every head waits for another key
        return None, False

    def _full(self, key: str, settings: Mapping[str, tuple[int | None, tuple[str, ...]]]) -> bool:
        """Whether ``key`` is at its limit, by a count without its lock.

        A shortcut for the common "a run was just queued on a full key", where
        it saves the lock: a count that says full is reliable, as each run it
        counted promotes on its own release, which sees the runs queued before.
        A count that says there is room is made again under the lock.
        """
        limit, statuses = settings.get(key, (None, ()))
        limit = self.scope.store.limit_overrides([key]).get(key, limit)  # an operator's limit replaces the code's
        if limit is None or not statuses:
            return False
        return self.scope.count(TAG_PREFIX + key, statuses) >= limit

    def _try_start(self, key: str, group: str, run_id: str, known: Mapping[str, tuple[int | None, tuple[str, ...]]]) -> str:
        """Start queued ``run_id`` if every key of it has room (counted under the keys' locks).

        Outcomes: "started", "filled" (started, and it took the last free slot of
        ``key``), "key full", "other key full" (another key of the run), "gone".
        ``known``: quota settings already read, by key.
        """
        store = self.scope.store
        keys = store.run_keys(run_id)
        settings = {k: known[k] for k in keys if k in known}
        missing = [k for k in keys if k not in known]
        if missing:
            settings.update(store.quota_settings(missing))
        quotas = [
            Quota(k, limit, statuses) for k, (limit, statuses) in sorted(settings.items()) if limit is not None and statuses
        ]
        room = None  # free slots of ``key`` before this start, when it has a quota
        with store.admission(quotas) as locked:
            for quota in locked or quotas:  # the limits in effect, read under the locks
                active = self.scope.count(quota.tag, quota.count_statuses)
                if active >= quota.limit:
                    return "key full" if quota.key == key else "other key full"
                if quota.key == key:
                    room = quota.limit - active
            if not store.transition(run_id, from_statuses=[RunStatus.QUEUED], to=RunStatus.PENDING):
                return "gone"  # another promoter took it, or it was cancelled
            store.set_rr_cursor(key, group)
        record = store.get_run(run_id)
        if record is not None:
            self.scope.send(record)
        logger.debug("Handed a slot of %s to queued run %s (group %r).", key, run_id, group)
        return "filled" if room == 1 else "started"
