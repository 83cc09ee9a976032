"""Concurrency quotas: the ``Concurrency`` declaration and its resolution at start.

Resolution turns a declaration plus a run's input into a ``Quota``: a plain key
string, an integer limit and the statuses to count. Admission (lock the key's
row, count, insert) is done by the engine through the store, see
``durable.runtime.starting``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import inspect
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async

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
    CANCEL_QUEUED_EXCEPT_NEWEST = "cancel_queued_except_newest"
    CANCEL_QUEUED_EXCEPT_OLDEST = "cancel_queued_except_oldest"

    def __str__(self) -> str:
        return self.value


#: The strategies that queue a start on a full key, and bound the queue with ``max_queued``.
QUEUEING_STRATEGIES = frozenset(
    {Strategy.GROUP_ROUND_ROBIN, Strategy.CANCEL_QUEUED_EXCEPT_NEWEST, Strategy.CANCEL_QUEUED_EXCEPT_OLDEST}
)
#: The queue-depth strategies: a full queue cancels a queued run (the oldest, or the newcomer)
#: instead of refusing the start; ``max_queued`` defaults to 1 for them.
QUEUE_DEPTH_STRATEGIES = frozenset({Strategy.CANCEL_QUEUED_EXCEPT_NEWEST, Strategy.CANCEL_QUEUED_EXCEPT_OLDEST})


def replaced_error(key: str, replaced_by: str) -> dict[str, str]:
    """The ``error`` of a queued run that start ``replaced_by`` cancelled to make
    room in the queue of ``key`` (CANCEL_QUEUED_EXCEPT_NEWEST), on every store."""
    return {
        "type": "durable.cancel_queued_except_newest",
        "message": f"Cancelled while queued: run {replaced_by!r} replaced it in the queue of concurrency key {key} "
        "(CANCEL_QUEUED_EXCEPT_NEWEST).",
        "key": key,
        "replaced_by": replaced_by,
    }


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


class _DefaultStrategy(str):
    """The value of ``Concurrency(strategy=...)`` when none is passed: ``REJECT``
    for a run's quota, queueing for a step's (``Concurrency.strategy_given``).

    It stays the ``strategy`` of a ``Concurrency`` given none (equal to
    ``Strategy.REJECT``, and ``Strategy(...)`` of it is that), so that
    ``dataclasses.replace``, which passes every field on, keeps it not given."""

    def __repr__(self) -> str:
        return "<default strategy: REJECT for a run, waiting for a step>"

    def __deepcopy__(self, memo: Any) -> _DefaultStrategy:
        return self


_DEFAULT_STRATEGY: Any = _DefaultStrategy(Strategy.REJECT.value)

#: An integer, a CEL expression over ``input`` and ``key`` (a string), or a sync
#: or async function of the key.
LimitSpec = int | str | Callable[[str], Any]

#: The variables a CEL key expression may use, and those of a CEL limit: the
#: limit also sees the key it is computed for (the key is resolved first).
KEY_VARIABLES = frozenset({"input"})
LIMIT_VARIABLES = frozenset({"input", "key"})


@dataclass(frozen=True)
class Concurrency:
    """A concurrency quota: at most ``limit`` runs of ``key`` in flight.

    ``key`` is a string (per start) or a function of the input returning a string,
    or ``None`` to leave that start unlimited. ``expression`` is the alternative:
    a CEL expression over ``input`` (``"input.group"``, or a constant such as
    ``"'global'"`` for one global limit). ``limit`` is an integer, a CEL
    expression over ``input`` and ``key`` giving one (``"input.tier == 'premium'
    ? 10 : 1"``), or a sync or async function of the key returning one.
    ``strategy`` says what happens to a start when the key is full; ``max_queued``
    bounds the key's queue: for ``GROUP_ROUND_ROBIN`` (unbounded by default; past
    it a start is refused), and for ``CANCEL_QUEUED_EXCEPT_NEWEST`` /
    ``CANCEL_QUEUED_EXCEPT_OLDEST`` the queue depth kept (default 1; past it the
    oldest queued run, or the newcomer, is cancelled).
    """

    key: KeySpec = None
    limit: LimitSpec = 1
    count_statuses: Sequence[str] = DEFAULT_CONCURRENCY_STATUSES
    strategy: Strategy = _DEFAULT_STRATEGY
    expression: str | None = None
    max_queued: int | None = None
    #: Borrowing beyond ``limit`` from a shared pool (``Strategy.REJECT`` only).
    burst: Burst | None = None
    _program: Any = field(default=None, init=False, repr=False, compare=False)
    _limit_program: Any = field(default=None, init=False, repr=False, compare=False)
    #: Compared: a step quota given no strategy waits, one given REJECT refuses.
    _strategy_given: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.key is None) == (self.expression is None):
            raise exceptions.InvalidStartError(
                "Concurrency takes exactly one of key=<string or function of the input> or "
                f"expression=<CEL expression>, got key={self.key!r}, expression={self.expression!r}."
            )
        if self.expression is not None:
            object.__setattr__(self, "_program", _compile_expression(self.expression, "expression", KEY_VARIABLES))
        elif not (isinstance(self.key, str) or callable(self.key)):
            raise exceptions.InvalidStartError(
                f"Concurrency(key=...) must be a string or a function of the input, got {self.key!r}."
            )
        if isinstance(self.key, str):
            _check_key(self.key)
        if isinstance(self.limit, str):
            object.__setattr__(self, "_limit_program", _compile_limit(self.limit))
        elif isinstance(self.limit, bool) or not (isinstance(self.limit, int) or callable(self.limit)):
            raise exceptions.InvalidStartError(
                "Concurrency(limit=...) must be an int, a CEL expression (a string) or a function of the key, "
                f"got {self.limit!r}."
            )
        elif isinstance(self.limit, int):
            _check_limit_range(self.limit, "Concurrency(limit=...)")
        statuses = self.count_statuses
        if isinstance(statuses, str) or not statuses or not set(statuses) <= COUNTABLE_STATUSES:
            raise exceptions.InvalidStartError(
                f"Concurrency(count_statuses=...) must be a non-empty list of run statuses "
                f"among {sorted(COUNTABLE_STATUSES)}, got {statuses!r}."
            )
        object.__setattr__(self, "count_statuses", tuple(dict.fromkeys(statuses)))
        given = not isinstance(self.strategy, _DefaultStrategy)
        object.__setattr__(self, "_strategy_given", given)
        try:
            strategy = Strategy(self.strategy)
        except ValueError:
            raise exceptions.InvalidStartError(f"Concurrency(strategy=...) must be a Strategy, got {self.strategy!r}.") from None
        if given:  # else the default stays, for dataclasses.replace to pass on
            object.__setattr__(self, "strategy", strategy)
        if strategy in QUEUE_DEPTH_STRATEGIES:
            _check_requeue_statuses(strategy, self.count_statuses)
            if self.max_queued is None:
                object.__setattr__(self, "max_queued", 1)
            if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 1:
                raise exceptions.InvalidStartError(
                    f"Concurrency(max_queued=...) is the queue depth of Strategy.{strategy.name}: a positive "
                    f"integer (default 1), got {self.max_queued!r}. To keep no queued run at all, use "
                    "Strategy.CANCEL_NEWEST."
                )
        elif self.max_queued is not None:
            if strategy is not Strategy.GROUP_ROUND_ROBIN:
                raise exceptions.InvalidStartError(
                    "Concurrency(max_queued=...) only applies to Strategy.GROUP_ROUND_ROBIN, "
                    "Strategy.CANCEL_QUEUED_EXCEPT_NEWEST and Strategy.CANCEL_QUEUED_EXCEPT_OLDEST."
                )
            if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 0:
                raise exceptions.InvalidStartError(
                    f"Concurrency(max_queued=...) must be a non-negative integer, got {self.max_queued!r}."
                )
        if self.burst is not None:
            _check_burst(self)

    @property
    def strategy_given(self) -> bool:
        """Whether ``strategy=`` was passed: a run's quota defaults to ``REJECT``,
        a step's (``ctx.step(..., concurrency=...)``) to waiting for a slot.
        ``dataclasses.replace`` keeps it unless it is given a ``strategy``."""
        return self._strategy_given

    @property
    def is_static(self) -> bool:
        """A plain string key and an integer limit: what a per-start quota takes."""
        return isinstance(self.key, str) and isinstance(self.limit, int)

    @property
    def limit_expression(self) -> str | None:
        """The CEL expression of the limit, or None for an integer or a function."""
        return self.limit if isinstance(self.limit, str) else None


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


#: Keys and limits computed ahead of ``resolve``, by position in the specs: the key
#: and its limit (None, None for a start the spec leaves unlimited), or the error
#: computing them gave.
Limits = Mapping[int, "tuple[str | None, int | None] | exceptions.InvalidStartError"]


def resolve(specs: Sequence[Concurrency], input: Any, *, limits: Limits | None = None) -> list[Quota]:
    """Compute the quotas of one start (user code runs here, before any lock is taken).

    ``limits``: keys and limits already computed, by position in ``specs`` (what
    ``aresolve_limits`` awaited); an error among them is raised when its
    position comes, as computing it here would have."""
    quotas: dict[str, Quota] = {}
    for position, spec in enumerate(specs):
        computed = None if limits is None else limits.get(position)
        if isinstance(computed, exceptions.InvalidStartError):
            raise computed
        key, limit = (_resolve_key(spec, input), None) if computed is None else computed
        if key is None:
            continue
        limit = _resolve_limit(spec, key, input) if limit is None else limit
        burst = None if spec.burst is None else PoolBurst(spec.burst.pool, spec.burst.up_to, pool_limit(spec.burst.pool))
        quota = Quota(key, limit, tuple(spec.count_statuses), Strategy(spec.strategy), spec.max_queued, burst)
        previous = quotas.get(key)
        if previous is not None and (previous.burst is not None or quota.burst is not None):
            raise _burst_shares_key(key)
        if previous is not None and previous.limit <= quota.limit:
            continue
        quotas[key] = quota
    # A stable order: every starter locks keys in the same order, so several keys
    # can never deadlock against each other.
    resolved = [quotas[k] for k in sorted(quotas)]
    _check_pools(resolved)
    depth = next((q for q in resolved if q.strategy in QUEUE_DEPTH_STRATEGIES), None)
    if depth is not None:
        for quota in resolved:
            _check_requeue_statuses(depth.strategy, quota.count_statuses, other=quota.key)
    return resolved


#: The statuses a run leaves and comes back from while it executes (a sleep, a
#: remote queue without a worker): a queue-depth key must count them.
_REENTERED_STATUSES = (RunStatus.SUSPENDED, RunStatus.BLOCKED)


def _check_requeue_statuses(strategy: Strategy, count_statuses: Sequence[str], *, other: str | None = None) -> None:
    """A run of a queue-depth key (CANCEL_QUEUED_EXCEPT_*) never goes back to ``queued``.

    A run coming back from a status that holds no slot of a full key is queued
    (``Executor.reenter``); the queue of a CANCEL_QUEUED_EXCEPT_* key holds runs that
    never started, and a newer start cancels its oldest: it would cancel a run that
    was executing, as "replaced". So every key of such a start counts the statuses a
    run comes back from."""
    missing = [s for s in _REENTERED_STATUSES if s not in count_statuses]
    if not missing:
        return
    where = f"its key {other!r} counts" if other is not None else "it counts"
    raise exceptions.InvalidStartError(
        f"Strategy.{strategy.name} needs every key of the start to count {' and '.join(missing)} runs "
        f"(count_statuses), but {where} {list(count_statuses)}: a run waking from a sleep onto a full key would "
        "be queued behind runs that never started, and a newer start would cancel it as replaced. Keep "
        "DEFAULT_CONCURRENCY_STATUSES, or add the missing statuses."
    )


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
    if Strategy(spec.strategy) is not Strategy.REJECT:
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


def _burst_shares_key(key: str) -> exceptions.InvalidStartError:
    """Two entries of one start resolve to ``key`` and one of them has a burst: which
    ceiling applies (the plain entry's limit, or the burst's up_to) is ambiguous."""
    return exceptions.InvalidStartError(
        f"Two concurrency entries of this start resolve to the key {key!r} and one has a burst: a key "
        "with a Burst takes no other entry (the plain entry's limit would not bound the burst's up_to). "
        "Keep one entry for the key: its limit is the guarantee, Burst(up_to=...) its ceiling."
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


async def aresolve_limits(specs: Sequence[Concurrency], input: Any) -> dict[int, Any]:
    """The keys and limits of the ``specs`` whose limit is an async function, that
    function awaited on the running event loop (no thread hop), by position in
    ``specs``: what an async start passes to ``resolve`` (see ``Limits``). The
    other specs are left to ``resolve``.

    An error is returned in place of its limit, for ``resolve`` to raise in the
    order a sync start would (an idempotent re-start of an existing run id, for
    one, returns that run before any quota is resolved)."""
    limits: dict[int, Any] = {}
    for position, spec in enumerate(specs):
        if not inspect.iscoroutinefunction(spec.limit):
            continue
        try:
            if callable(spec.key):
                # A key function may read the database: it runs in a thread, as a sync start runs it.
                key = await sync_to_async(_resolve_key)(spec, input)
            else:
                key = _resolve_key(spec, input)  # a string or a CEL expression: pure
            if key is None:
                limits[position] = (None, None)
                continue
            try:
                limit = await spec.limit(key)
            except Exception as exc:
                raise _limit_function_error(exc, key) from exc
            limits[position] = (key, _checked_limit(limit, key))
        except exceptions.InvalidStartError as exc:
            limits[position] = exc
    return limits


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


def _compile_expression(expression: Any, option: str, variables: frozenset[str]) -> Any:
    """Compile the CEL of ``Concurrency(<option>=...)``, which may use ``variables`` only."""
    if not isinstance(expression, str) or not expression.strip():
        raise exceptions.InvalidStartError(f"Concurrency({option}=...) must be a CEL expression string, got {expression!r}.")
    # Imported here: the package loads its command-line interface (prompt_toolkit) with it,
    # about 0.2 s that a process declaring no CEL quota need not spend.
    import cel

    try:
        program = cel.compile(expression)
    except ValueError as exc:
        raise exceptions.InvalidStartError(f"Invalid CEL concurrency {option} {expression!r}: {exc}") from exc
    unknown = set(program.variables()) - variables
    if unknown:
        allowed = " and ".join(f"`{v}`" for v in sorted(variables))
        raise exceptions.InvalidStartError(
            f"The CEL concurrency {option} {expression!r} may only use {allowed}, not {', '.join(sorted(unknown))}."
        )
    return program


def _compile_limit(expression: str) -> Any:
    """Compile a CEL limit; one that uses no variable (``"5"``) is evaluated now,
    so that a constant that is no limit (``"2.5"``, ``"1/0"``) fails here, not at start."""
    program = _compile_expression(expression, "limit", LIMIT_VARIABLES)
    if not program.variables():
        _limit_value(_execute_limit(program, expression, {}, "at declaration"), expression, "at declaration")
    return program


def _execute_limit(program: Any, expression: str, variables: dict[str, Any], where: str) -> Any:
    try:
        return program.execute(variables)
    except Exception as exc:
        hint = " Check that the input has the fields the limit is computed from." if "input" in program.variables() else ""
        raise exceptions.InvalidStartError(
            f"The concurrency limit expression {expression!r} raised {type(exc).__name__} {where}: {str(exc).rstrip('.')}.{hint}",
        ) from exc


#: CEL's names of the Python values a CEL program gives, for error messages.
_CEL_TYPES: dict[type, str] = {
    float: "double",
    bool: "bool",
    str: "string",
    bytes: "bytes",
    type(None): "null",
    list: "list",
    dict: "map",
}


def _limit_value(value: Any, expression: str, where: str) -> int:
    """The integer a CEL limit gave: CEL converts nothing, so a double, a bool, a
    string or null is refused (``int(...)`` converts in the expression)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise exceptions.InvalidStartError(
            f"The concurrency limit expression {expression!r} must give an integer, got {value!r} "
            f"(a {_CEL_TYPES.get(type(value), type(value).__name__)}) {where}. CEL converts nothing by itself: "
            "write int(...) in the expression if need be."
        )
    _check_limit_range(value, f"The concurrency limit expression {expression!r} {where}")
    return value


def _check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY_LENGTH:
        raise exceptions.InvalidStartError(f"A concurrency key must be 1 to {MAX_KEY_LENGTH} characters long, got {key!r}.")


def _resolve_limit(spec: Concurrency, key: str, input: Any) -> int:
    limit: Any = spec.limit
    if isinstance(limit, str):
        where = f"for key {key!r}"
        return _limit_value(_execute_limit(spec._limit_program, limit, {"input": input, "key": key}, where), limit, where)
    if callable(limit):
        try:
            if inspect.iscoroutinefunction(limit):
                limit = _run_async(limit(key))
            else:
                limit = limit(key)
                if inspect.isawaitable(limit):
                    limit = _run_async(_await(limit))
        except Exception as exc:
            raise _limit_function_error(exc, key) from exc
    return _checked_limit(limit, key)


def _limit_function_error(exc: Exception, key: str) -> exceptions.InvalidStartError:
    return exceptions.InvalidStartError(f"The concurrency limit function raised {type(exc).__name__} for key {key!r}: {exc}.")


def _checked_limit(limit: Any, key: str) -> int:
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
