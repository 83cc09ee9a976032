"""What operators and UIs ask of admission: would a start be admitted now
(``Engine.would_admit``), and a key's limit changed live (``Engine.set_limit_override``).

``would_admit`` decides exactly as a start does (``admission.decide``, with each
key's limit in effect) but locks nothing and writes nothing: its answer is what a
start would get at the moment it counted, not a reservation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from durable import concurrency as _concurrency
from durable import exceptions
from durable.runtime import admission, bursts
from durable.status import RunStatus
from durable.stores.base import LimitChangeRecord

#: The outcomes of ``would_admit``: the run would start ("admit", or
#: "cancel_in_progress": after cancelling the oldest runs of a full key), be
#: created queued ("queue"; with CANCEL_QUEUED_EXCEPT_NEWEST, ``detail`` names the
#: queued runs it would replace) or already cancelled ("cancel_newest": by
#: CANCEL_NEWEST, or CANCEL_QUEUED_EXCEPT_OLDEST on a full queue), or be refused
#: ("reject": ``ConcurrencyLimitError``; "queue_full": ``ConcurrencyQueueFullError``).
#: "exists": the run id names a run already, which a start returns as it is.
OUTCOMES = ("admit", "cancel_in_progress", "queue", "cancel_newest", "reject", "queue_full", "exists")
_ADMITTED = frozenset({"admit", "cancel_in_progress"})

#: Longest reason of a limit change.
MAX_REASON_LENGTH = 2000


@dataclass(frozen=True)
class KeyCheck:
    """One key of a dry run: the limit in effect (``override`` if set, else the
    code's ``code_limit``), what is in flight and queued, and its strategy."""

    key: str
    limit: int
    code_limit: int
    override: int | None
    active: int
    queued: int
    strategy: str
    max_queued: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "limit": self.limit,
            "code_limit": self.code_limit,
            "override": self.override,
            "active": self.active,
            "queued": self.queued,
            "strategy": self.strategy,
            "max_queued": self.max_queued,
        }


@dataclass(frozen=True)
class AdmissionCheck:
    """What ``Engine.would_admit`` answers: whether the start would be admitted now
    (``admitted``: it would start running), the ``outcome`` (one of ``OUTCOMES``), the
    key that decided it with its ``limit`` and ``active`` count (the first key for
    an admitted start; None without quotas), every key, and for a refusal the
    ``detail`` and ``retry_after`` the start's error would carry."""

    admitted: bool
    outcome: str
    workflow: str
    key: str | None = None
    limit: int | None = None
    active: int | None = None
    keys: list[KeyCheck] = field(default_factory=list)
    detail: str = ""
    retry_after: int | None = None

    def __bool__(self) -> bool:
        return self.admitted

    def as_dict(self) -> dict[str, Any]:
        """The JSON body of ``POST runs/?dry_run=1``."""
        data: dict[str, Any] = {
            "admitted": self.admitted,
            "outcome": self.outcome,
            "workflow": self.workflow,
            "key": self.key,
            "limit": self.limit,
            "active": self.active,
            "keys": [k.as_dict() for k in self.keys],
        }
        if self.detail:
            data["detail"] = self.detail
        if self.retry_after is not None:
            data["retry_after"] = self.retry_after
        return data


def check(scope: admission.Scope, workflow: str, quotas: Sequence[_concurrency.Quota]) -> AdmissionCheck:
    """Decide a start of ``workflow`` under ``quotas`` (the code's limits) as
    ``admission.decide`` does, without locks or writes."""
    overrides = scope.store.limit_overrides([q.key for q in quotas] + bursts.pools_of(quotas)) if quotas else {}
    effective = bursts.with_overrides(quotas, overrides)
    keys = []
    for code, quota in zip(quotas, effective, strict=True):
        queued = scope.count(quota.tag, [RunStatus.QUEUED]) if quota.strategy in _concurrency.QUEUEING_STRATEGIES else 0
        keys.append(
            KeyCheck(
                key=quota.key,
                limit=quota.limit,
                code_limit=code.limit,
                override=overrides.get(quota.key),
                active=scope.count(quota.tag, quota.count_statuses),
                queued=queued,
                strategy=str(quota.strategy.value),
                max_queued=quota.max_queued,
            )
        )
    try:
        decision = admission.decide(scope, workflow, effective)
    except exceptions.ConcurrencyLimitError as exc:
        queue_full = isinstance(exc, exceptions.ConcurrencyQueueFullError)
        return AdmissionCheck(
            admitted=False,
            outcome="queue_full" if queue_full else "reject",
            workflow=workflow,
            key=exc.key,
            limit=exc.limit,
            active=exc.active,
            keys=keys,
            detail=str(exc),
            retry_after=exc.retry_after,
        )
    if decision.status == RunStatus.CANCELLED:
        outcome = "cancel_newest"
    elif decision.status == RunStatus.QUEUED:
        outcome = "queue"
    elif decision.victims:
        outcome = "cancel_in_progress"
    else:
        outcome = "admit"
    # The key that decided: the first full one of the deciding strategy, else the first key.
    deciding = next((k for k in keys if k.active >= k.limit or k.queued), keys[0] if keys else None)
    return AdmissionCheck(
        admitted=outcome in _ADMITTED,
        outcome=outcome,
        workflow=workflow,
        key=None if deciding is None else deciding.key,
        limit=None if deciding is None else deciding.limit,
        active=None if deciding is None else deciding.active,
        keys=keys,
        detail=decision.reason,
    )


def existing(workflow: str, run_id: str) -> AdmissionCheck:
    """The answer for a start whose run id names a run already: it would return that run."""
    return AdmissionCheck(
        admitted=False,
        outcome="exists",
        workflow=workflow,
        detail=f"The run id {run_id!r} names a run already: a start returns it and starts nothing.",
    )


def check_override(key: Any, limit: Any, reason: Any) -> tuple[str, int | None, str]:
    """The arguments of a limit change, checked: ``InvalidStartError`` names what is wrong."""
    if not isinstance(key, str) or not 0 < len(key) <= _concurrency.MAX_KEY_LENGTH or "\x00" in key:
        raise exceptions.InvalidStartError(
            f"A concurrency key is a string of 1 to {_concurrency.MAX_KEY_LENGTH} characters, got {key!r}."
        )
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not _concurrency.MIN_LIMIT <= limit <= _concurrency.MAX_LIMIT
    ):
        raise exceptions.InvalidStartError(
            f"A limit override is an integer from {_concurrency.MIN_LIMIT} to {_concurrency.MAX_LIMIT} "
            f"(0 or less refuses every start), or None to clear it, got {limit!r}."
        )
    if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON_LENGTH or "\x00" in reason:
        raise exceptions.InvalidStartError(
            f"A limit change needs a reason: a non-empty text of at most {MAX_REASON_LENGTH} characters, got {reason!r}."
        )
    return key, limit, reason.strip()


def user_name(user: Any) -> str:
    """How the audit trail names ``user`` (kept when the user is deleted)."""
    if user is None:
        return ""
    get_username = getattr(user, "get_username", None)
    return str(get_username() if callable(get_username) else user)[:255]


__all__ = ["OUTCOMES", "AdmissionCheck", "KeyCheck", "LimitChangeRecord", "check", "check_override"]
