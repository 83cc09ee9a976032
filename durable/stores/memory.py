"""``InMemoryStore``: the whole store in a dict, for tests and scripts.

Thread-safe (one lock serialises admission and state changes) but not shared
across processes.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.utils import timezone

from durable.concurrency import TAG_PREFIX, Quota
from durable.status import TERMINAL_STATUSES, RunStatus
from durable.stores.base import (
    DURATION_EVERY,
    SLOT_WAIT_PREFIX,
    BaseStore,
    Finished,
    LimitChangeRecord,
    RunExists,
    RunRecord,
    SlotAnswer,
    StepEntry,
    add_duration,
    estimate,
    group_keys,
)


@dataclass
class _Slot:
    """A step's slot of a step-level quota (``durable.models.StepSlot``)."""

    key: str
    run_id: str
    position: int
    status: str  # "held" | "waiting"
    limit: int
    lease: str = ""


class InMemoryStore(BaseStore):
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._runs: dict[str, RunRecord] = {}
        self._steps: dict[str, dict[int, StepEntry]] = {}
        #: run id -> buffered signals [name, payload, consumed position or None]
        self._signals: dict[str, list[list[Any]]] = {}
        #: key -> (limit, count_statuses) of the last start, and the round-robin cursors.
        self._quotas: dict[str, tuple[int | None, tuple[str, ...]]] = {}
        self._cursors: dict[str, str] = {}
        #: run id -> tag -> group key
        self._groups: dict[str, dict[str, str]] = {}
        #: key -> an operator's limit; every change of it; key -> recent run durations.
        self._overrides: dict[str, int] = {}
        self.limit_changes: list[LimitChangeRecord] = []
        self._durations: dict[str, list[float]] = {}
        self._durations_at: dict[str, datetime] = {}
        #: (run id, position) -> its step slot, in arrival order (dicts keep insertion order).
        self._slots: dict[tuple[str, int], _Slot] = {}

    # -- reads -------------------------------------------------------------
    def get_run(self, run_id: str) -> RunRecord | None:
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else copy.deepcopy(run)

    def _select(
        self,
        workflow: str | None,
        tag: str | None,
        statuses: Sequence[str] | None,
        namespace: str | None,
    ) -> list[RunRecord]:
        return [
            run
            for run in self._runs.values()
            if (workflow is None or run.workflow == workflow)
            and (tag is None or tag in run.tags)
            and (statuses is None or run.status in statuses)
            and (namespace is None or run.namespace == namespace)
        ]

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> list[RunRecord]:
        with self._lock:
            runs = self._select(workflow, tag, statuses, namespace)
            runs.sort(key=lambda r: r.created_at or timezone.now(), reverse=True)
            return copy.deepcopy(runs)

    def count_runs(
        self,
        *,
        tag: str | None = None,
        statuses: Sequence[str] | None = None,
        namespace: str | None = None,
    ) -> int:
        with self._lock:
            return len(self._select(None, tag, statuses, namespace))

    # -- admission ---------------------------------------------------------
    @contextmanager
    def admission(self, quotas: Sequence[Quota]) -> Iterator[Sequence[Quota]]:
        with self._lock:
            for quota in quotas:
                self._quotas[quota.key] = (quota.limit, tuple(quota.count_statuses))
            yield [replace(q, limit=self._overrides[q.key]) if q.key in self._overrides else q for q in quotas]

    def limit_overrides(self, keys: Sequence[str]) -> dict[str, int]:
        with self._lock:
            return {k: self._overrides[k] for k in keys if k in self._overrides}

    def set_limit_override(
        self, key: str, limit: int | None, *, reason: str, changed_by: Any = None, changed_by_name: str = ""
    ) -> LimitChangeRecord:
        with self._lock:
            code_limit = self._quotas.get(key, (None, ()))[0]
            old = self._overrides.get(key)
            if limit is None:
                self._overrides.pop(key, None)
            else:
                self._overrides[key] = limit
            self._quotas.setdefault(key, (None, ()))
            change = LimitChangeRecord(
                key=key,
                old_override=old,
                new_override=limit,
                old_limit=code_limit if old is None else old,
                new_limit=code_limit if limit is None else limit,
                reason=reason,
                changed_by_name=changed_by_name,
                changed_at=timezone.now(),
            )
            self.limit_changes.append(change)
            return change

    def retry_estimate(self, quota: Quota, *, namespace: str | None = None) -> float | None:
        with self._lock:
            durations = self._durations.get(quota.key)
            if not durations:
                return None
            created = [r.created_at for r in self._select(None, quota.tag, quota.count_statuses, namespace) if r.created_at]
            age = (timezone.now() - min(created)).total_seconds() if created else None
            return estimate(durations, age)

    def run_exists(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self._runs

    def create_run(self, record: RunRecord, tags: Sequence[str]) -> None:
        with self._lock:
            if record.run_id in self._runs:
                raise RunExists(record.run_id)
            now = timezone.now()
            self._runs[record.run_id] = replace(
                copy.deepcopy(record),
                tags=list(tags),
                created_at=now,
                updated_at=now,
                dispatched_at=now,
            )
            self._groups[record.run_id] = group_keys(tags)

    def on_commit(self, fn: Callable[[], object]) -> None:
        fn()

    # -- state changes -------------------------------------------------------
    def _update(self, run_id: str, check: Callable[[RunRecord], bool], **fields: Any) -> bool:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or not check(run):
                return False
            for name, value in fields.items():
                setattr(run, name, value)
            run.updated_at = timezone.now()
            return True

    def transition(
        self,
        run_id: str,
        *,
        from_statuses: Sequence[str],
        to: str,
        expect: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> bool:
        def check(run: RunRecord) -> bool:
            return run.status in from_statuses and all(getattr(run, k) == v for k, v in (expect or {}).items())

        if to == RunStatus.PENDING:  # a pending run's message is sent now: the sweeper waits from here
            fields = {"dispatched_at": timezone.now(), "redispatches": 0, **fields}
        return self._update(run_id, check, status=to, **fields)

    def claim(self, run_id: str, *, lease: str, worker: str, stale_before: datetime) -> RunRecord | None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return None
            stale = run.status == RunStatus.RUNNING and (run.heartbeat_at is None or run.heartbeat_at < stale_before)
            if run.status not in (RunStatus.PENDING, RunStatus.BLOCKED) and not stale:
                return None
            now = timezone.now()
            run.status, run.lease, run.worker = RunStatus.RUNNING, lease, worker
            run.attempt += 1
            run.heartbeat_at = now
            run.started_at = run.started_at or now
            run.updated_at = now
            run.redispatches = 0
            return copy.deepcopy(run)

    def _owned(self, lease: str) -> Callable[[RunRecord], bool]:
        return lambda r: r.status == RunStatus.RUNNING and r.lease == lease

    def heartbeat(self, run_id: str, lease: str) -> bool:
        return self._update(run_id, self._owned(lease), heartbeat_at=timezone.now())

    def finish(self, run_id: str, lease: str, *, status: str, output: Any = None, error: Any = None) -> bool | Finished:
        with self._lock:
            now = timezone.now()
            done = self._update(
                run_id,
                self._owned(lease),
                status=status,
                output=copy.deepcopy(output),
                error=error,
                lease="",
                finished_at=now,
            )
            run = self._runs[run_id] if done else None
            if run is not None and run.created_at is not None:
                # The time its slots were held, for the keys' Retry-After estimates.
                for tag in run.tags:
                    key = tag[len(TAG_PREFIX) :]
                    last = self._durations_at.get(key)
                    if tag.startswith(TAG_PREFIX) and (last is None or (now - last).total_seconds() >= DURATION_EVERY):
                        self._durations[key] = add_duration(self._durations.get(key), (now - run.created_at).total_seconds())
                        self._durations_at[key] = now
            if run is None:
                return False
            return Finished(
                hand_off=any(tag.startswith(TAG_PREFIX) for tag in run.tags),
                held_slots=any(r == run_id for r, _ in self._slots),
            )

    def retry(self, run_id: str, *, from_statuses: Sequence[str], tags: Sequence[str]) -> bool:
        with self._lock:
            run = self._runs.get(run_id)
            previous = None if run is None else run.status
            done = self._update(
                run_id,
                lambda r: r.status in from_statuses,
                status=RunStatus.PENDING,
                output=None,
                error=None,
                attempt=0,
                lease="",
                started_at=None,  # the retry's first claim sets it again (run_started)
                finished_at=None,
                dispatched_at=timezone.now(),
                redispatches=0,
                tags=list(tags),
            )
            if done:
                assert run is not None
                run.generation += 1
                self._groups[run_id] = group_keys(tags)
                steps = self._steps.get(run_id, {})
                last = max(steps, default=None)
                if previous == RunStatus.FAILED and last is not None and steps[last].outcome == "failed":
                    del steps[last]  # the failure that ended the run: it runs again
                for ident in [i for i in self._slots if i[0] == run_id]:  # they count no more
                    del self._slots[ident]
            return done

    # -- journal -------------------------------------------------------------
    def load_steps(self, run_id: str) -> list[StepEntry]:
        with self._lock:
            return [s for _, s in sorted(self._steps.get(run_id, {}).items())]

    def record_step(self, run_id: str, lease: str, step: StepEntry) -> bool:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or not self._owned(lease)(run):
                return False
            steps = self._steps.setdefault(run_id, {})
            previous = steps.get(step.position)
            if previous is not None and previous.outcome != "waiting":
                raise ValueError(f"step {step.position} of run {run_id} is recorded already")
            steps[step.position] = copy.deepcopy(step)
            run.heartbeat_at = timezone.now()
            return True

    # -- waiting -----------------------------------------------------------------
    def suspend(self, run_id: str, lease: str, *, waiting_for: str, wake_at: datetime | None) -> bool:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or not self._owned(lease)(run):
                return False
            kind, _, target = waiting_for.partition(":")
            if kind == "signal" and any(n == target and pos is None for n, _, pos in self._signals.get(run_id, [])):
                return False
            child = self._runs.get(target) if kind == "child" else None
            if child is not None and child.status in TERMINAL_STATUSES:
                return False
            return self._update(
                run_id,
                lambda r: True,
                status=RunStatus.SUSPENDED,
                waiting_for=waiting_for,
                wake_at=wake_at,
                lease="",
                attempt=0,
            )

    def add_signal(self, run_id: str, name: str, payload: Any) -> RunRecord | None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return None
            if run.status not in TERMINAL_STATUSES:
                self._signals.setdefault(run_id, []).append([name, copy.deepcopy(payload), None])
            return copy.deepcopy(run)

    def consume_signal(self, run_id: str, lease: str, name: str, step: StepEntry) -> tuple[bool, Any]:
        with self._lock:
            for signal in self._signals.get(run_id, []):
                if signal[0] == name and signal[2] is None:
                    if not self.record_step(run_id, lease, replace(step, output={"payload": signal[1]})):
                        return False, None
                    signal[2] = step.position
                    return True, copy.deepcopy(signal[1])
            return False, None

    def active_children(self, run_id: str) -> list[RunRecord]:
        with self._lock:
            return [
                copy.deepcopy(r) for r in self._runs.values() if r.parent_run_id == run_id and r.status not in TERMINAL_STATUSES
            ]

    def due_runs(self, now: datetime) -> list[RunRecord]:
        with self._lock:
            return [
                copy.deepcopy(r)
                for r in self._runs.values()
                if r.status == RunStatus.SUSPENDED and r.wake_at is not None and r.wake_at <= now
            ]

    def waiting_parents(self) -> list[RunRecord]:
        with self._lock:
            found = []
            for run in self._runs.values():
                kind, _, target = run.waiting_for.partition(":")
                child = self._runs.get(target) if run.status == RunStatus.SUSPENDED and kind == "child" else None
                if child is not None and child.status in TERMINAL_STATUSES:
                    found.append(copy.deepcopy(run))
            return found

    def runs_on_queues(self, statuses: Sequence[str]) -> list[RunRecord]:
        with self._lock:
            return [copy.deepcopy(r) for r in self._runs.values() if r.status in statuses and r.queue]

    # -- strategies ------------------------------------------------------------
    def run_keys(self, run_id: str) -> list[str]:
        with self._lock:
            run = self._runs.get(run_id)
            tags = run.tags if run else []
            return sorted(t[len(TAG_PREFIX) :] for t in tags if t.startswith(TAG_PREFIX))

    def quota_settings(self, keys: Sequence[str]) -> dict[str, tuple[int | None, tuple[str, ...]]]:
        with self._lock:
            return {k: self._quotas[k] for k in keys if k in self._quotas}

    def queued_heads(self, tag: str, *, namespace: str | None = None) -> list[tuple[str, str]]:
        with self._lock:
            heads: dict[str, RunRecord] = {}
            for run in self._runs.values():  # insertion order is arrival order
                if run.status == RunStatus.QUEUED and tag in run.tags and namespace in (None, run.namespace):
                    heads.setdefault(self._groups[run.run_id][tag], run)
            return sorted((group, run.run_id) for group, run in heads.items())

    def rr_cursor(self, key: str) -> str:
        with self._lock:
            return self._cursors.get(key, "")

    def set_rr_cursor(self, key: str, group: str) -> None:
        with self._lock:
            self._cursors[key] = group

    def keys_with_queued(self) -> dict[str, list[str]]:
        with self._lock:
            pairs = {
                (r.namespace, t[len(TAG_PREFIX) :])
                for r in self._runs.values()
                if r.status == RunStatus.QUEUED
                for t in r.tags
                if t.startswith(TAG_PREFIX)
            }
        found: dict[str, list[str]] = {}
        for namespace, key in sorted(pairs):
            found.setdefault(namespace, []).append(key)
        return found

    # -- step-level quotas ------------------------------------------------------
    def _held(self, key: str) -> int:
        def counts(slot: _Slot) -> bool:
            run = self._runs.get(slot.run_id)
            step = self._steps.get(slot.run_id, {}).get(slot.position)
            journaled = step is not None and step.outcome in ("completed", "failed")
            return run is not None and run.status not in TERMINAL_STATUSES and not journaled

        return sum(1 for s in self._slots.values() if s.key == key and s.status == "held" and counts(s))

    def _hand_off(self, key: str) -> list[str]:
        woken: list[str] = []
        override = self._overrides.get(key)
        for ident, slot in list(self._slots.items()):
            if slot.key != key or slot.status != "waiting":
                continue
            run = self._runs.get(slot.run_id)
            if run is None or run.status in TERMINAL_STATUSES:
                del self._slots[ident]
                continue
            if self._held(key) >= (slot.limit if override is None else override):
                break
            slot.status, slot.lease = "held", ""
            woken.append(slot.run_id)
        return woken

    def acquire_slot(self, run_id: str, lease: str, position: int, *, key: str, limit: int, queue: bool) -> SlotAnswer:
        with self._lock:
            in_effect = self._overrides.get(key, limit)
            run = self._runs.get(run_id)
            if run is None or not self._owned(lease)(run):
                return SlotAnswer("lost")
            mine = self._slots.get((run_id, position))
            if mine is not None:
                if mine.key == key and mine.status == "held" and mine.lease in ("", lease):
                    mine.lease = lease
                    return SlotAnswer("held", limit=in_effect)
                del self._slots[(run_id, position)]  # a dead execution's (taken over), or woken otherwise
            woken = self._hand_off(key)
            active = self._held(key)
            waiting = any(s.key == key and s.status == "waiting" for s in self._slots.values())
            if in_effect > 0 and active < in_effect and not waiting:
                self._slots[(run_id, position)] = _Slot(key, run_id, position, "held", limit, lease)
                return SlotAnswer("held", active + 1, in_effect, tuple(woken))
            if not queue or in_effect <= 0:
                return SlotAnswer("full", active, in_effect, tuple(woken))
            self._slots[(run_id, position)] = _Slot(key, run_id, position, "waiting", limit)
            self._update(
                run_id,
                lambda r: True,
                status=RunStatus.SUSPENDED,
                waiting_for=SLOT_WAIT_PREFIX + key,
                wake_at=None,
                lease="",
                attempt=max(0, run.attempt - 1),  # a death before this park stays counted
            )
            return SlotAnswer("waiting", active, in_effect, tuple(woken))

    def release_slot(self, run_id: str, position: int, *, key: str, lease: str) -> list[str]:
        with self._lock:
            mine = self._slots.get((run_id, position))
            if mine is None or mine.key != key or mine.status != "held" or mine.lease != lease:
                return []
            del self._slots[(run_id, position)]
            return self._hand_off(mine.key)

    def release_run_slots(self, run_id: str) -> list[tuple[str, str]]:
        with self._lock:
            run = self._runs.get(run_id)
            if run is not None and run.status not in TERMINAL_STATUSES:
                return []  # retried since it ended: its rows are its new execution's
            keys = sorted({s.key for (r, _), s in self._slots.items() if r == run_id})
            for ident in [i for i in self._slots if i[0] == run_id]:
                del self._slots[ident]
            return [(key, woken) for key in keys for woken in self._hand_off(key)]

    def hand_off_key_slots(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        with self._lock:
            return [(key, run_id) for key in sorted(set(keys)) for run_id in self._hand_off(key)]

    def hand_off_slots(self) -> list[tuple[str, str]]:
        with self._lock:
            for ident, slot in list(self._slots.items()):  # rows that no longer count
                run = self._runs.get(slot.run_id)
                step = self._steps.get(slot.run_id, {}).get(slot.position)
                ended = run is None or run.status in TERMINAL_STATUSES
                if slot.status == "held" and (ended or (step is not None and step.outcome != "waiting")):
                    del self._slots[ident]
            keys = sorted({s.key for s in self._slots.values() if s.status == "waiting"})
            woken = [(key, run_id) for key in keys for run_id in self._hand_off(key)]
            for slot in self._slots.values():
                run = self._runs.get(slot.run_id)
                parked = run is not None and run.status == RunStatus.SUSPENDED and run.waiting_for == SLOT_WAIT_PREFIX + slot.key
                if slot.status == "held" and parked and (slot.key, slot.run_id) not in woken:
                    woken.append((slot.key, slot.run_id))
            return woken

    # -- recovery ------------------------------------------------------------
    def orphaned_runs(self, heartbeat_before: datetime, dispatched_before: Sequence[datetime] = ()) -> list[RunRecord]:
        with self._lock:
            return [
                copy.deepcopy(r)
                for r in self._runs.values()
                if r.status == RunStatus.RUNNING
                and r.heartbeat_at is not None
                and r.heartbeat_at < heartbeat_before
                and (not dispatched_before or r.redispatches == 0 or _redispatch_due(r, dispatched_before))
            ]

    def undelivered_runs(self, dispatched_before: Sequence[datetime]) -> list[RunRecord]:
        with self._lock:
            return [
                copy.deepcopy(r)
                for r in self._runs.values()
                if r.status == RunStatus.PENDING and _redispatch_due(r, dispatched_before)
            ]

    def mark_dispatched(self, run_ids: Sequence[str]) -> None:
        with self._lock:
            for run_id in run_ids:
                if run_id in self._runs:
                    self._runs[run_id].dispatched_at = timezone.now()
                    self._runs[run_id].redispatches += 1

    def purge_finished(self, before: Mapping[str, datetime], *, limit: int) -> list[str]:
        with self._lock:
            unfinished_parents = {r.parent_run_id for r in self._runs.values() if r.status not in TERMINAL_STATUSES}

            def still_counted(run: RunRecord) -> bool:  # by a lifetime cap (see retention.still_counted)
                keys = (tag[len(TAG_PREFIX) :] for tag in run.tags if tag.startswith(TAG_PREFIX))
                return any(run.status in self._quotas.get(key, (None, ()))[1] for key in keys)

            order = {status: i for i, status in enumerate(before)}
            expired = sorted(
                (
                    r
                    for r in self._runs.values()
                    if r.status in before
                    and r.finished_at is not None
                    and r.finished_at < before[r.status]
                    and r.run_id not in unfinished_parents
                    and not still_counted(r)
                ),
                key=lambda r: (order[r.status], r.finished_at),
            )[:limit]
            for run in expired:
                del self._runs[run.run_id]
                self._steps.pop(run.run_id, None)
                self._signals.pop(run.run_id, None)
                self._groups.pop(run.run_id, None)
            gone = {run.run_id for run in expired}
            for run in self._runs.values():
                if run.parent_run_id in gone:
                    run.parent_run_id = None
            return [run.run_id for run in expired]


def _redispatch_due(run: RunRecord, dispatched_before: Sequence[datetime]) -> bool:
    before = dispatched_before[min(run.redispatches, len(dispatched_before) - 1)]
    return run.dispatched_at is not None and run.dispatched_at < before
