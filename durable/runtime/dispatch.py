"""The dispatcher contract: how the engine hands runs to whatever executes them.

The engine knows no Celery: ``durable.tasks.CeleryDispatcher`` (wired into the
default engine by ``durable/__init__.py``) sends runs to Celery workers;
``InlineDispatcher`` executes them in the caller's thread (tests, scripts).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from durable.stores.base import RunRecord

if TYPE_CHECKING:
    from durable.runtime.engine import Engine


class Dispatcher:
    """Hands runs to what executes them. Every method defaults to doing nothing:
    a subclass overrides what its executor can do. What a dispatcher leaves out,
    the sweeper covers (it re-sends pending runs, wakes due ones)."""

    def send(self, engine: Engine, run: RunRecord) -> None:
        """Hand a new, woken or recovered run to what executes it (``engine.execute(run.run_id)``).

        Called inside the transaction that made the run ``pending``: send on
        commit (``engine.store.on_commit``), and never raise once committed."""

    def revoke(self, engine: Engine, run: RunRecord) -> None:
        """The run was cancelled: drop its messages not yet started (best effort)."""

    def wake_later(self, engine: Engine, run: RunRecord, eta: datetime) -> None:
        """A timer for a sleeping run: ``engine.executor.wake_due(run.run_id)`` at ``eta``
        (a fast path: the sweeper wakes due runs too)."""

    def live_queues(self) -> list[str] | None:
        """The queues some live worker consumes (for remote workflows), or None
        when there are no workers to ask (runs are then never ``blocked``)."""
        return None


#: A dispatcher given as a plain function ``fn(engine, run)``: it only sends.
DispatchFn = Callable[["Engine", RunRecord], None]
DispatcherLike = Dispatcher | DispatchFn


class FunctionDispatcher(Dispatcher):
    """A plain function ``fn(engine, run)`` as a dispatcher: ``send`` calls it."""

    def __init__(self, fn: DispatchFn) -> None:
        self.fn = fn

    def __repr__(self) -> str:
        return f"FunctionDispatcher({self.fn!r})"

    def send(self, engine: Engine, run: RunRecord) -> None:
        self.fn(engine, run)


class InlineDispatcher(Dispatcher):
    """Execute the run right away in the caller's thread, once the start commits
    (for tests and scripts). Sleeping runs wake through the sweeper."""

    def send(self, engine: Engine, run: RunRecord) -> None:
        run_id = run.run_id
        engine.store.on_commit(lambda: engine.execute(run_id))


inline_dispatch = InlineDispatcher()


def as_dispatcher(dispatch: DispatcherLike | None) -> Dispatcher:
    """``dispatch`` as a ``Dispatcher``: a plain function is wrapped (it only sends);
    None is the default dispatcher (see ``set_default``)."""
    if dispatch is None:
        return default()
    if isinstance(dispatch, Dispatcher):
        return dispatch
    if callable(dispatch):
        return FunctionDispatcher(dispatch)
    raise TypeError(f"A dispatcher is a durable.runtime.dispatch.Dispatcher or a function fn(engine, run), got {dispatch!r}.")


_default: Dispatcher | None = None


def set_default(dispatcher: Dispatcher) -> None:
    """The dispatcher of engines built without one (``durable`` sets the Celery one)."""
    global _default
    _default = dispatcher


def default() -> Dispatcher:
    if _default is None:
        raise RuntimeError("No default dispatcher is set: import durable, or pass Engine(dispatch=...).")
    return _default
