"""``DurableWorkflow``: the class-based way to declare a workflow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from durable import concurrency as _concurrency
from durable.runtime.context import WorkflowContext
from durable.runtime.engine import Engine, RunHandle


class DurableWorkflow:
    """Subclass with ``name``, ``version``, ``concurrency`` and ``run(ctx, input)``.

    Each concrete subclass registers itself with ``engine`` (the default engine
    unless the class sets another) when the class is created.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    concurrency: ClassVar[_concurrency.ConcurrencySpec] = None
    #: Event names that start this workflow (``engine.emit``).
    on_events: ClassVar[Sequence[str]] = ()
    engine: ClassVar[Engine | None] = None
    #: Set on an intermediate base class that must not be registered itself.
    abstract: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("abstract", False):
            return
        if not cls.name:
            raise TypeError(f"{cls.__qualname__} must set a workflow `name` (or `abstract = True`).")
        if cls.run is DurableWorkflow.run:
            raise TypeError(f"{cls.__qualname__} must define run(self, ctx, input).")
        cls._engine().register(cls.name, str(cls.version), cls._execute, cls.concurrency, on_events=cls.on_events)

    @classmethod
    def _engine(cls) -> Engine:
        if cls.engine is not None:
            return cls.engine
        from durable import engine

        return engine

    @classmethod
    def _execute(cls, ctx: WorkflowContext, input: Any) -> Any:
        return cls().run(ctx, input)

    def run(self, ctx: WorkflowContext, input: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def start(
        cls,
        input: Any = None,
        run_id: str | None = None,
        concurrency: _concurrency.ConcurrencySpec = None,
    ) -> RunHandle:
        # This class's own version, also when a newer version of the workflow is registered.
        return cls._engine().start(cls.name, input, run_id=run_id, concurrency=concurrency, version=str(cls.version))

    @classmethod
    def dispatch(cls, input: Any = None, concurrency: _concurrency.ConcurrencySpec = None) -> RunHandle:
        return cls.start(input, concurrency=concurrency)

    @classmethod
    async def astart(
        cls,
        input: Any = None,
        run_id: str | None = None,
        concurrency: _concurrency.ConcurrencySpec = None,
    ) -> RunHandle:
        """``start`` for async code (see ``Engine.astart``)."""
        return await cls._engine().astart(cls.name, input, run_id=run_id, concurrency=concurrency, version=str(cls.version))

    @classmethod
    async def adispatch(cls, input: Any = None, concurrency: _concurrency.ConcurrencySpec = None) -> RunHandle:
        return await cls.astart(input, concurrency=concurrency)
