"""What the parts of ``DjangoStore`` share: the database alias and its connection,
the querysets, the retry on a lost connection, and runs read back as
``RunRecord`` (from a model instance, or from ``jsonb`` that durable's SQL
functions answer)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.db import InterfaceError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from durable.stores import kept
from durable.stores.base import BaseStore, RunRecord, group_keys

if TYPE_CHECKING:
    from durable.models import WorkflowRun

RECORD_FIELDS = (
    "run_id",
    "workflow",
    "version",
    "namespace",
    "status",
    "input",
    "output",
    "error",
    "attempt",
    "generation",
    "lease",
    "worker",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
    "heartbeat_at",
    "dispatched_at",
    "redispatches",
    "queue",
    "waiting_for",
    "wake_at",
    "fenced",
)

DATETIME_FIELDS = ("created_at", "updated_at", "started_at", "finished_at", "heartbeat_at", "dispatched_at", "wake_at")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def reconnecting(method: _Method) -> _Method:
    """Run an idempotent store call once more on a fresh connection when the first
    try lost its connection (a database restart, ``pg_terminate_backend``, a network
    blip). Not inside a caller's transaction: that one is lost anyway."""

    @functools.wraps(method)
    def call(self: ORMStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (OperationalError, InterfaceError):
            if not self.recover():
                raise
            return method(self, *args, **kwargs)

    return cast(_Method, call)


def kept_connection(method: _Method) -> _Method:
    """Inside ``BaseStore.keep_connection`` (a worker's execution), the ORM statements of
    this store call run on the thread's kept connection (``durable.stores.kept.serving``),
    as the lifecycle statements do (``ORMStore._lifecycle``): a worker then opens no
    new PostgreSQL backend for a run's suspension, signals, step slots or wake-up,
    though Celery closes Django's connection around every task. For a method that is
    a generator (under ``contextlib.contextmanager``), the whole ``with`` block."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def block(self: ORMStore, *args: Any, **kwargs: Any) -> Any:
            with kept.serving(self.using):
                return (yield from method(self, *args, **kwargs))

        return cast(_Method, block)

    @functools.wraps(method)
    def call(self: ORMStore, *args: Any, **kwargs: Any) -> Any:
        if not kept.active():
            return method(self, *args, **kwargs)
        with kept.serving(self.using):
            return method(self, *args, **kwargs)

    return cast(_Method, call)


def models() -> Any:
    # Imported lazily: the store is built before the app registry is ready.
    from durable import models

    return models


class ORMStore(BaseStore):
    """The base of ``DjangoStore`` and of its parts (``durable.stores.admitting``,
    ``durable.stores.lifecycle``): the alias ``using`` and what every part reads with."""

    def __init__(self, using: str = "default") -> None:
        self.using = using

    def _postgres(self) -> BaseDatabaseWrapper | None:
        """This store's connection when it is PostgreSQL, where durable's SQL
        functions are installed (one round trip per state change); else None, and
        the store takes its generic ORM path."""
        connection = connections[self.using]
        return connection if connection.vendor == "postgresql" else None

    def _lifecycle(self) -> BaseDatabaseWrapper | None:
        """Where durable's statements of a run's lifecycle go on PostgreSQL (its
        claim, lease check, journal writes, finish, hand-off): inside
        ``keep_connection`` the thread's kept connection (``durable.stores.kept``),
        unless Django's connection is in a transaction (the statements then belong
        to it); else Django's connection. None off PostgreSQL."""
        connection = self._postgres()
        if connection is None:
            return None
        return kept.chosen(self.using) or connection

    def keep_connection(self) -> contextlib.AbstractContextManager[None]:
        """On PostgreSQL, durable's statements of the executions meanwhile (the lifecycle's,
        and the ORM calls marked ``kept_connection``) run on a connection this thread
        keeps across executions (see ``durable.stores.kept``)."""
        return kept.kept() if self._postgres() is not None else contextlib.nullcontext()

    def _runs(self) -> Any:
        return models().WorkflowRun.objects.using(self.using)

    def _tags(self) -> Any:
        return models().RunTag.objects.using(self.using)

    def _create_tags(self, run: WorkflowRun, tags: Sequence[str]) -> None:
        if not tags:
            return
        RunTag = models().RunTag
        groups = group_keys(tags)
        RunTag.objects.using(self.using).bulk_create(
            [RunTag(run=run, tag=t, status=run.status, namespace=run.namespace, group_key=groups[t]) for t in tags]
        )

    def on_commit(self, fn: Callable[[], object]) -> None:
        if kept.active() and connections[self.using].connection is None:
            # In an execution whose statements ran on the kept connection, Django's is
            # not even open, so no transaction of it waits: call now, as Django would
            # once it had connected to read its autocommit.
            fn()
            return
        transaction.on_commit(fn, using=self.using)

    def release_thread(self) -> None:
        """Close this thread's connection (called by helper threads when they end)."""
        with contextlib.suppress(OperationalError, InterfaceError):  # a broken connection is gone already
            connections[self.using].close()

    def recover(self) -> bool:
        """Close this thread's connection (and its kept one, ``durable.stores.kept``)
        if an error left it unusable, so that the next query opens a fresh one.
        False inside a transaction (its owner must roll back first)."""
        connection = connections[self.using]
        if connection.in_atomic_block:
            return False
        connection.close_if_unusable_or_obsolete()
        kept.recover(self.using)
        return True


def run_record(row: dict[str, Any]) -> RunRecord:
    """A run read back as ``jsonb`` (a row of ``durable_workflowrun`` with ``parent_run_id``)."""
    for name in DATETIME_FIELDS:
        row[name] = from_iso(row[name])
    return RunRecord(**{name: row[name] for name in RECORD_FIELDS}, parent_run_id=row["parent_run_id"])


def jsonb(value: Any) -> str | None:
    """A JSON value as a ``jsonb`` parameter; None is SQL NULL, as the ORM stores it."""
    return None if value is None else json.dumps(value)


def decoded(value: Any) -> Any:
    """A ``jsonb`` result: the driver may hand it over decoded or as text."""
    return json.loads(value) if isinstance(value, str) else value


def from_iso(value: str | None) -> datetime | None:
    """A ``timestamptz`` read back from ``jsonb`` (ISO 8601), in UTC as the ORM reads it."""
    return None if value is None else datetime.fromisoformat(value).astimezone(UTC)


def to_record(run: WorkflowRun) -> RunRecord:
    record = RunRecord(**{name: getattr(run, name) for name in RECORD_FIELDS})
    if run.parent is not None:
        record.parent_run_id = run.parent.run_id
    return record
