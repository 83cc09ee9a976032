"""Every error durable raises. No Django or DRF import here.

Each class carries a stable ``code`` (used in HTTP bodies) and its docstring is
the default message.
"""

from __future__ import annotations

from typing import Any


class DurableError(Exception):
    """A durable operation failed."""

    code = "durable_error"

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)
        self.fields = fields
        super().__init__(message or (self.__doc__ or "").strip())


class ConcurrencyLimitError(DurableError):
    """The concurrency quota of this key is full: retry shortly."""

    code = "concurrency_limit"

    workflow: str
    key: str
    limit: int
    active: int
    #: Seconds to wait before retrying (estimated per key, see ``durable.conf.retry_after_seconds``);
    #: None when the raiser gave none (the HTTP API then sends ``RETRY_AFTER``).
    retry_after: int | None
    #: What refused: "limit" (a key without a burst: its limit), or for a key with a
    #: burst "pool" (its guaranteed slots are taken and its pool is full) or "up_to"
    #: (it has ``Burst.up_to`` runs in flight, guaranteed and borrowed, or its limit if higher).
    source: str
    #: With a burst (else None): the pool, its limit in effect and runs in flight,
    #: ``up_to``, and how many of the key's ``active`` runs are borrowed.
    pool: str | None
    pool_limit: int | None
    pool_active: int | None
    up_to: int | None
    borrowed: int | None

    def __init__(
        self,
        *,
        workflow: str,
        key: str,
        limit: int,
        active: int,
        hint: str = "",
        retry_after: int | None = None,
        source: str = "limit",
        pool: str | None = None,
        pool_limit: int | None = None,
        pool_active: int | None = None,
        up_to: int | None = None,
        borrowed: int | None = None,
    ) -> None:
        if source == "pool":
            message = (
                f"Concurrency limit reached for key {key!r}: its {limit} guaranteed slots are taken and its burst "
                f"pool {pool!r} is full ({pool_active} of {pool_limit} runs in flight) (workflow {workflow!r}). "
            )
        elif source == "up_to":
            message = (
                f"Concurrency limit reached for key {key!r}: {active} runs in flight, its burst ceiling "
                f"(up_to={up_to}; {limit} guaranteed, {borrowed} borrowed from pool {pool!r}) (workflow {workflow!r}). "
            )
        else:
            message = f"Concurrency limit reached for key {key!r}: {active} of {limit} runs in flight (workflow {workflow!r}). "
        burst = {}
        if pool is not None:  # a burst's figures: journaled with the rest (a refused child replays the same)
            burst = {"source": source, "pool": pool, "pool_limit": pool_limit, "pool_active": pool_active}
            burst.update(up_to=up_to, borrowed=borrowed)
        super().__init__(
            message + (hint or "Retry when one of them has finished."),
            workflow=workflow,
            key=key,
            limit=limit,
            active=active,
            **burst,
        )
        # Not one of ``fields``: set after the error is made (a refusal's estimate).
        self.retry_after = retry_after
        self.source = source
        self.pool, self.pool_limit, self.pool_active = pool, pool_limit, pool_active
        self.up_to, self.borrowed = up_to, borrowed

    @property
    def burst_fields(self) -> dict[str, object]:
        """What a 429 body adds for a key with a burst: ``source`` and the pool's figures (none for another key)."""
        return {name: self.fields[name] for name in BURST_FIELDS if name in self.fields}


#: What a ``ConcurrencyLimitError`` of a key with a burst carries besides the usual fields.
BURST_FIELDS = ("source", "pool", "pool_limit", "pool_active", "up_to", "borrowed")


#: The hint of a ``ConcurrencyLimitError`` on a lifetime cap that its finished runs fill.
LIFETIME_CAP_HINT = "Its finished runs alone fill this lifetime cap: no start of this key can be admitted again."


def holding_ancestor_hint(run_id: str) -> str:
    """The hint of a ``ConcurrencyLimitError`` refusing a child that would queue behind ``run_id``."""
    return (
        f"Its ancestor run {run_id!r} holds a slot of this key: a child queued behind it "
        "could wait for it forever, so it is refused instead."
    )


class ConcurrencyQueueFullError(ConcurrencyLimitError):
    """The queue of this concurrency key is full: retry shortly."""

    code = "concurrency_queue_full"

    queued: int
    max_queued: int

    def __init__(
        self,
        *,
        workflow: str,
        key: str,
        limit: int,
        active: int,
        queued: int,
        max_queued: int,
        retry_after: int | None = None,
    ) -> None:
        self.retry_after = retry_after
        self.source = "limit"
        self.pool = self.pool_limit = self.pool_active = self.up_to = self.borrowed = None
        DurableError.__init__(
            self,
            f"The queue of concurrency key {key!r} is full: {queued} runs wait (max_queued={max_queued}) "
            f"behind {active} of {limit} in flight (workflow {workflow!r}). Retry when it has drained.",
            workflow=workflow,
            key=key,
            limit=limit,
            active=active,
            queued=queued,
            max_queued=max_queued,
        )


class PoolBusyError(DurableError):
    """A start inside your transaction that would borrow from its burst pool found the
    pool locked by another transaction: retry your transaction shortly."""

    code = "pool_busy"

    workflow: str
    #: The pools the start's bursts borrow from (one of them was busy).
    pools: list[str]
    #: How many times the start was tried.
    attempts: int

    def __init__(self, *, workflow: str, pools: list[str], attempts: int) -> None:
        super().__init__(
            f"A start of workflow {workflow!r} inside your transaction would borrow from its burst pool "
            f"({', '.join(map(repr, pools))}), which stayed locked by another transaction through {attempts} "
            "attempts: durable never waits for a pool inside your transaction (it may hold keys sorting after "
            "the pool, and waiting could deadlock). Nothing was created; retry the transaction shortly, or "
            "start the run outside it.",
            workflow=workflow,
            pools=pools,
            attempts=attempts,
        )


class InvalidStartError(DurableError, ValueError):
    """The start was refused because its input or concurrency settings are invalid."""

    code = "invalid_start"


class UnknownWorkflowError(DurableError, LookupError):
    """No workflow is registered under this name."""

    code = "unknown_workflow"


class RunNotFound(DurableError, LookupError):
    """No run has this id."""

    code = "run_not_found"


class RunIdTaken(DurableError):
    """This run id is already used by another run (another workflow or namespace); choose another run id."""

    code = "run_id_taken"


class RunTerminalError(DurableError):
    """The run has already finished; it cannot be changed any more."""

    code = "run_terminal"


class RunFailedError(DurableError):
    """The run did not complete."""

    code = "run_failed"


class InvalidScheduleError(DurableError, ValueError):
    """The schedule was refused because some of its settings are invalid; nothing was saved."""

    code = "invalid_schedule"

    #: ``{field: [message, ...]}``, keyed by the ``Schedule`` model's field names.
    errors: dict[str, list[str]]

    def __init__(self, errors: dict[str, list[str]]) -> None:
        message = " ".join(m for messages in errors.values() for m in messages)
        super().__init__(message or None, errors=errors)


class ScheduleNotFound(DurableError, LookupError):
    """No schedule has this name."""

    code = "schedule_not_found"


class FatalError(Exception):
    """Raise in a step to fail it at once: a FatalError is never retried."""


class NonDeterminismError(DurableError):
    """The workflow code no longer matches the run's journal."""

    code = "non_determinism"


class ChildWorkflowError(DurableError):
    """A child workflow failed (or could not be started)."""

    code = "child_failed"


class SignalTimeout(DurableError, TimeoutError):
    """No signal arrived before the wait's timeout."""

    code = "signal_timeout"


class Suspend(BaseException):
    """Internal: the run parks until ``wake_at`` or until what it waits for arrives.

    Raised by the workflow context; the executor catches it. A ``BaseException``
    so that a workflow's ``except Exception`` does not swallow it.
    """

    def __init__(self, waiting_for: str, wake_at: Any = None, *, parked: bool = False) -> None:
        super().__init__(waiting_for)
        self.waiting_for = waiting_for
        self.wake_at = wake_at
        #: The store parked the run already (a step waiting for a slot of its quota).
        self.parked = parked


class RunCancelled(BaseException):
    """Internal: the run was cancelled; unwinds the workflow at a step boundary.

    A ``BaseException`` so that a workflow's ``except Exception`` does not swallow it.
    """


class StoreUnavailable(BaseException):
    """Internal: one of durable's own store calls failed (the database went away, its
    connection dropped); the original error is the ``__cause__``.

    Raised by the workflow context; the executor catches it and ends the execution
    without a verdict, so the run is delivered again. A ``BaseException`` so that a
    workflow's ``except Exception`` never mistakes durable's infrastructure for its own
    failure.
    """
