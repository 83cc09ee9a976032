"""Concurrency quotas: the ``Concurrency`` declaration and its resolution at start.

Resolution turns a declaration plus a run's input into a ``Quota``: a plain key
string, an integer limit and the statuses to count. Admission (lock the key's
row, count, insert) is done by the engine through the store, see
``durable.runtime.engine``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import inspect
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import cel
from asgiref.sync import async_to_sync

from durable import conf, exceptions
from durable.status import ALL_STATUSES, DEFAULT_CONCURRENCY_STATUSES, RunStatus

#: What ``count_statuses`` may name: ``queued`` never holds a slot.
COUNTABLE_STATUSES = ALL_STATUSES - {RunStatus.QUEUED}

#: Longest key accepted; the tag ``concurrency:<key>`` must fit its column.
MAX_KEY_LENGTH = 200
TAG_PREFIX = "concurrency:"
#: The tag of a run that borrowed a slot of its key's burst pool: ``borrowed:<key>``
#: (the run also carries ``concurrency:<pool>``). See ``Burst``.
BORROWED_PREFIX = "borrowed:"
#: The range of a limit: what the database's integer columns hold (``limit <= 0``
#: rejects every start).
MIN_LIMIT, MAX_LIMIT = -(2**31), 2**31 - 1


class Strategy(str, enum.Enum):
    REJECT = "reject"
    GROUP_ROUND_ROBIN = "group_round_robin"
    CANCEL_IN_PROGRESS = "cancel_in_progress"
    CANCEL_NEWEST = "cancel_newest"

    def __str__(self) -> str:
        return self.value


KeySpec = str | Callable[[Any], str | None] | None


@dataclass(frozen=True)
class Burst:
    """Capacity a key may borrow beyond its ``limit``: from the shared ``pool``, up
    to ``up_to`` runs of the key in flight in total, only while the pool has room.

    ``pool`` names a pool declared in ``DURABLE["POOLS"]`` (``{"global": 50}``:
    its limit). A run admitted within the key's ``limit`` is guaranteed and counts
    against the key only; a run admitted beyond it is borrowed and counts against
    the key and the pool (it carries the tags ``concurrency:<pool>`` and
    ``borrowed:<key>``), until it finishes. See docs/explanation/burst.md.
    """

    pool: str
    up_to: int

    def __post_init__(self) -> None:
        if not isinstance(self.pool, str):
            raise exceptions.InvalidStartError(f"Burst(pool=...) must name a pool of DURABLE['POOLS'], got {self.pool!r}.")
        _check_key(self.pool)
        if isinstance(self.up_to, bool) or not isinstance(self.up_to, int) or not 1 <= self.up_to <= MAX_LIMIT:
            raise exceptions.InvalidStartError(
                f"Burst(up_to=...) must be a positive integer (the most runs of the key in flight, "
                f"guaranteed and borrowed), got {self.up_to!r}."
            )


@dataclass(frozen=True)
class PoolBurst:
    """A resolved ``Burst``: the pool, ``up_to``, and the pool's limit (in effect,
    once admission has read an operator's override under the pool's lock)."""

    pool: str
    up_to: int
    pool_limit: int

    @property
    def pool_tag(self) -> str:
        return TAG_PREFIX + self.pool


LimitSpec = int | Callable[[str], Any]


@dataclass(frozen=True)
class Concurrency:
    """A concurrency quota: at most ``limit`` runs of ``key`` in flight.

    ``key`` is a string (per start) or a function of the input returning a string,
    or ``None`` to leave that start unlimited. ``expression`` is the alternative:
    a CEL expression over ``input`` (``"input.group"``, or a constant such as
    ``"'global'"`` for one global limit). ``limit`` is an integer or a sync or
    async function of the key returning one. ``strategy`` says what happens to a
    start when the key is full; ``max_queued`` bounds a ``GROUP_ROUND_ROBIN`` queue.
    """

    key: KeySpec = None
    limit: LimitSpec = 1
    count_statuses: Sequence[str] = DEFAULT_CONCURRENCY_STATUSES
    strategy: Strategy = Strategy.REJECT
    expression: str | None = None
    max_queued: int | None = None
    #: Borrowing beyond ``limit`` from a shared pool (``Strategy.REJECT`` only).
    burst: Burst | None = None
    _program: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.key is None) == (self.expression is None):
            raise exceptions.InvalidStartError(
                "Concurrency takes exactly one of key=<string or function of the input> or "
                f"expression=<CEL expression>, got key={self.key!r}, expression={self.expression!r}."
            )
        if self.expression is not None:
            object.__setattr__(self, "_program", _compile_expression(self.expression))
        elif not (isinstance(self.key, str) or callable(self.key)):
            raise exceptions.InvalidStartError(
                f"Concurrency(key=...) must be a string or a function of the input, got {self.key!r}."
            )
        if isinstance(self.key, str):
            _check_key(self.key)
        if isinstance(self.limit, bool) or not (isinstance(self.limit, int) or callable(self.limit)):
            raise exceptions.InvalidStartError(
                f"Concurrency(limit=...) must be an int or a function of the key, got {self.limit!r}."
            )
        if isinstance(self.limit, int):
            _check_limit_range(self.limit, "Concurrency(limit=...)")
        statuses = self.count_statuses
        if isinstance(statuses, str) or not statuses or not set(statuses) <= COUNTABLE_STATUSES:
            raise exceptions.InvalidStartError(
                f"Concurrency(count_statuses=...) must be a non-empty list of run statuses "
                f"among {sorted(COUNTABLE_STATUSES)}, got {statuses!r}."
            )
        object.__setattr__(self, "count_statuses", tuple(dict.fromkeys(statuses)))
        try:
            strategy = Strategy(self.strategy)
        except ValueError:
            raise exceptions.InvalidStartError(f"Concurrency(strategy=...) must be a Strategy, got {self.strategy!r}.") from None
        object.__setattr__(self, "strategy", strategy)
        if self.max_queued is not None:
            if strategy is not Strategy.GROUP_ROUND_ROBIN:
                raise exceptions.InvalidStartError("Concurrency(max_queued=...) only applies to Strategy.GROUP_ROUND_ROBIN.")
            if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 0:
                raise exceptions.InvalidStartError(
                    f"Concurrency(max_queued=...) must be a non-negative integer, got {self.max_queued!r}."
                )
        if self.burst is not None:
            _check_burst(self)

    @property
    def is_static(self) -> bool:
        """A plain string key and an integer limit: what a per-start quota takes."""
        return isinstance(self.key, str) and not callable(self.limit)


@dataclass(frozen=True)
class Quota:
    """A resolved quota for one start."""

    key: str
    limit: int
    count_statuses: tuple[str, ...]
    strategy: Strategy = Strategy.REJECT
    max_queued: int | None = None
    burst: PoolBurst | None = None

    @property
    def tag(self) -> str:
        return TAG_PREFIX + self.key

    @property
    def borrowed_tag(self) -> str:
        """The tag of this key's runs that borrowed from its burst pool."""
        return BORROWED_PREFIX + self.key


ConcurrencySpec = Concurrency | Sequence[Concurrency] | None


def normalize(spec: ConcurrencySpec) -> tuple[Concurrency, ...]:
    """Accept one ``Concurrency``, a list of them, or ``None``."""
    if spec is None:
        return ()
    if isinstance(spec, Concurrency):
        return (spec,)
    if isinstance(spec, (list, tuple)) and all(isinstance(c, Concurrency) for c in spec):
        return tuple(spec)
    raise exceptions.InvalidStartError(f"concurrency must be a Concurrency or a list of them, got {spec!r}.")


def resolve(specs: Sequence[Concurrency], input: Any) -> list[Quota]:
    """Compute the quotas of one start (user code runs here, before any lock is taken)."""
    quotas: dict[str, Quota] = {}
    for spec in specs:
        key = _resolve_key(spec, input)
        if key is None:
            continue
        limit = _resolve_limit(spec, key)
        burst = None if spec.burst is None else PoolBurst(spec.burst.pool, spec.burst.up_to, pool_limit(spec.burst.pool))
        quota = Quota(key, limit, tuple(spec.count_statuses), Strategy(spec.strategy), spec.max_queued, burst)
        previous = quotas.get(key)
        if previous is not None and previous.limit <= quota.limit:
            continue
        quotas[key] = quota
    # A stable order: every starter locks keys in the same order, so several keys
    # can never deadlock against each other.
    resolved = [quotas[k] for k in sorted(quotas)]
    _check_pools(resolved)
    return resolved


def pool_limit(pool: str) -> int:
    """The limit of ``pool`` declared in ``DURABLE["POOLS"]`` (``InvalidStartError`` if it is not)."""
    pools = conf.settings.POOLS or {}
    limit = pools.get(pool) if isinstance(pools, dict) else None
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise exceptions.InvalidStartError(
            f"Burst(pool={pool!r}) names no pool: declare it with its limit in the settings, "
            f"DURABLE = {{'POOLS': {{{pool!r}: 50}}}}."
        )
    _check_limit_range(limit, f"The limit of pool {pool!r}")
    return limit


def _check_burst(spec: Concurrency) -> None:
    """What a ``Concurrency`` with ``burst`` must be (its pool's limit is read at start)."""
    assert spec.burst is not None
    if not isinstance(spec.burst, Burst):
        raise exceptions.InvalidStartError(f"Concurrency(burst=...) must be a Burst, got {spec.burst!r}.")
    if spec.strategy is not Strategy.REJECT:
        raise exceptions.InvalidStartError(
            f"Concurrency(burst=...) only applies to Strategy.REJECT, not {spec.strategy}: a start beyond "
            "the key's limit borrows from the pool or is refused, it is never queued nor cancels runs."
        )
    if tuple(spec.count_statuses) != DEFAULT_CONCURRENCY_STATUSES:
        raise exceptions.InvalidStartError(
            "Concurrency(burst=...) counts the default statuses (DEFAULT_CONCURRENCY_STATUSES), as its pool "
            f"does; got count_statuses={list(spec.count_statuses)!r}."
        )
    if isinstance(spec.limit, int) and spec.burst.up_to < spec.limit:
        raise exceptions.InvalidStartError(
            f"Burst(up_to={spec.burst.up_to}) is the most runs of the key in flight in all, guaranteed "
            f"(limit={spec.limit}) and borrowed: it must be at least the limit."
        )


def _check_pools(quotas: Sequence[Quota]) -> None:
    """A start that borrows takes no other strategy than REJECT (its other keys
    included); a quota on a key that is a pool uses the pool's limit and statuses."""
    if any(q.burst is not None for q in quotas) and any(q.strategy is not Strategy.REJECT for q in quotas):
        raise exceptions.InvalidStartError(
            "A start with a Concurrency(burst=...) takes Strategy.REJECT on every one of its keys: "
            "a start that borrows from a pool is never queued nor cancels runs."
        )
    pools = conf.settings.POOLS or {}
    for quota in quotas:
        if isinstance(pools, dict) and quota.key in pools:
            declared = pool_limit(quota.key)
            if quota.limit != declared or quota.count_statuses != DEFAULT_CONCURRENCY_STATUSES or quota.burst is not None:
                raise exceptions.InvalidStartError(
                    f"The key {quota.key!r} is a pool (DURABLE['POOLS']): a quota on it takes the pool's "
                    f"limit ({declared}), the default count_statuses and no burst of its own; "
                    f"got limit={quota.limit}, count_statuses={list(quota.count_statuses)!r}."
                )


def _resolve_key(spec: Concurrency, input: Any) -> str | None:
    if isinstance(spec.key, str):
        return spec.key
    what = "key function" if spec.expression is None else f"key expression {spec.expression!r}"
    try:
        key = spec.key(input) if callable(spec.key) else spec._program.execute({"input": input})
    except Exception as exc:
        raise exceptions.InvalidStartError(
            f"The concurrency {what} raised {type(exc).__name__}: {exc}. "
            "Check that the input has the fields the key is built from.",
        ) from exc
    if key is None:
        # A key function returning None, or an expression evaluating to null,
        # leaves this start unlimited.
        return None
    if not isinstance(key, str):
        raise exceptions.InvalidStartError(f"The concurrency {what} must give a string or None, got {key!r}.")
    _check_key(key)
    return key


def _compile_expression(expression: Any) -> Any:
    if not isinstance(expression, str) or not expression.strip():
        raise exceptions.InvalidStartError(f"Concurrency(expression=...) must be a CEL expression string, got {expression!r}.")
    try:
        program = cel.compile(expression)
    except ValueError as exc:
        raise exceptions.InvalidStartError(f"Invalid CEL concurrency expression {expression!r}: {exc}") from exc
    unknown = set(program.variables()) - {"input"}
    if unknown:
        raise exceptions.InvalidStartError(
            f"The CEL concurrency expression {expression!r} may only use `input`, not {', '.join(sorted(unknown))}."
        )
    return program


def _check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY_LENGTH:
        raise exceptions.InvalidStartError(f"A concurrency key must be 1 to {MAX_KEY_LENGTH} characters long, got {key!r}.")


def _resolve_limit(spec: Concurrency, key: str) -> int:
    limit: Any = spec.limit
    if callable(limit):
        try:
            if inspect.iscoroutinefunction(limit):
                limit = _run_async(limit(key))
            else:
                limit = limit(key)
                if inspect.isawaitable(limit):
                    limit = _run_async(_await(limit))
        except Exception as exc:
            raise exceptions.InvalidStartError(
                f"The concurrency limit function raised {type(exc).__name__} for key {key!r}: {exc}.",
            ) from exc
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise exceptions.InvalidStartError(f"A concurrency limit must be an integer, got {limit!r} for key {key!r}.")
    _check_limit_range(limit, f"The concurrency limit for key {key!r}")
    return limit


def _check_limit_range(limit: int, what: str) -> None:
    if not MIN_LIMIT <= limit <= MAX_LIMIT:
        raise exceptions.InvalidStartError(
            f"{what} must be from {MIN_LIMIT} to {MAX_LIMIT} (a 32-bit integer; 0 or less rejects every start), got {limit!r}."
        )


def _run_async(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """The result of an async limit function, from sync code.

    ``async_to_sync`` when no event loop runs in this thread; when one does (a
    start called straight from a coroutine), which ``async_to_sync`` refuses,
    the coroutine runs to completion on a loop of its own in a worker thread
    (the calling loop waits meanwhile).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return async_to_sync(_await)(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="durable-limit") as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _await(awaitable: Any) -> Any:
    return await awaitable
