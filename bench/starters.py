"""One "start" per system, as a benchmark process calls it.

- ``DispatchStarter``: ``FirstStep.dispatch`` (``bench.firststep``), a
  ``DurableWorkflow`` on durable's default engine: the start as users call it,
  its Celery message sent to the benchmark's Redis broker on commit.
- ``DurableStarter``: the real ``Engine.start`` (lock row, count, insert run and
  tag), with a no-op dispatch instead of the Celery send: a shortcut whose runs
  never execute (and the engine of sections (b), (c), (e)).
- ``RawStarter``: the same logical transaction written by hand in psycopg 3,
  statement for statement (see ``RawStarter.start``). It is the ceiling durable is
  measured against, so it is written the way one would naturally write it.
- ``ProcrastinateStarter``: ``task.defer()`` on a sync procrastinate app.
- ``RoundTrip``: not a start: ``SELECT 1`` through Django's cursor or bare
  psycopg, the floor under any refusal's latency on this machine.
- ``DbosStarter``: ``DBOSClient.enqueue()`` onto a DBOS queue. The client only
  enqueues: no DBOS executor runs, so nothing dequeues during the measurement,
  as no Celery worker consumes the queue of durable's messages in (a).

The parent-side ``install_procrastinate`` and ``install_dbos`` put the two
libraries' schemas into the scratch databases; each returns why it could not.
"""

from __future__ import annotations

import functools
import json
import traceback
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench import schema
from durable.status import DEFAULT_CONCURRENCY_STATUSES

#: Workflow started in section (a) and (c): a quota of ``RATE_LIMIT`` per key, so
#: that nothing is refused there.
WORKFLOW = "bench.noop"
#: Workflow started against the hot key of section (b); its limit is set per run.
HOT_WORKFLOW = "bench.hot"
#: Workflow of section (e): ``GROUP_ROUND_ROBIN``, its limit set per run.
GRR_WORKFLOW = "bench.grr"
#: A workflow of one step, executed in the benchmark process to count its statements.
ONE_STEP_WORKFLOW = "bench.one_step"
VERSION = "1"
RATE_LIMIT = 1000
#: Name of the procrastinate task and the DBOS workflow; the queue of both.
JOB_NAME = "bench_noop"
QUEUE = "bench"


def key_of(input: dict[str, Any]) -> str:
    """The concurrency key function of the benchmark workflows."""
    return str(input["key"])


def _noop_body(ctx: Any, input: Any) -> None:
    return None


def _one_step_body(ctx: Any, input: Any) -> Any:
    return ctx.step("only", _noop_job, str(input["key"]))


def _no_dispatch(engine: Any, run: Any) -> None:
    """Dispatch that sends nothing: the benchmark measures admission, not Celery."""


def _noop_job(key: str) -> None:
    return None


class DispatchStarter:
    """``FirstStep.dispatch``: durable's default engine and Celery dispatcher, message sent on commit.

    ``background``: the message goes through durable's background publisher (the
    default, ``PUBLISH_IN_BACKGROUND``); False sends it on the caller's thread once
    the transaction commits (``apply_async``, the path before the publisher).
    ``batch_interval``: the publisher's ``PUBLISH_BATCH_INTERVAL`` (None: the default).
    ``templates``: False puts the publisher's templates aside (``publishing.TEMPLATES``).
    ``direct``: False sends every message through the publisher's thread: the caller
    never writes one itself (``publishing.DIRECT_WRITES``).
    ``prepared``: each round on a connection with prepared statements (see ``begin``).
    ``finish`` waits until every message of the round is on the broker: the round's
    time includes it.
    """

    def __init__(
        self,
        background: bool = True,
        batch_interval: float | None = None,
        prepared: bool = False,
        templates: bool = True,
        direct: bool = True,
    ) -> None:
        from bench.firststep import FirstStep

        self.workflow = FirstStep
        self.background = background
        self.batch_interval = batch_interval
        self.templates = templates
        self.direct = direct
        self.prepared = prepared
        self._before: dict[str, Any] = {}
        self._options: dict[str, Any] | None = None

    def begin(self) -> None:
        """Publish this round's messages as ``background``, ``batch_interval``, ``templates`` and ``direct`` say, until ``end``;
        with ``prepared``, on a connection with Django's server-side binding and psycopg's prepared
        statements (``OPTIONS`` ``server_side_binding``, ``prepare_threshold`` 5, psycopg's default)."""
        from django.conf import settings
        from django.db import connection

        from durable.tasks import publishing

        self._before = getattr(settings, "DURABLE", {})
        chosen: dict[str, Any] = {"PUBLISH_IN_BACKGROUND": self.background}
        if self.batch_interval is not None:
            chosen["PUBLISH_BATCH_INTERVAL"] = self.batch_interval
        settings.DURABLE = {**self._before, **chosen}
        publishing.TEMPLATES = self.templates
        publishing.DIRECT_WRITES = self.direct
        if self.prepared:
            connection.close()
            self._options = connection.settings_dict.get("OPTIONS") or {}
            connection.settings_dict["OPTIONS"] = {**self._options, "server_side_binding": True, "prepare_threshold": 5}

    def end(self) -> None:
        """Put back what ``begin`` changed: the sections after (a) dispatch with the default."""
        from django.conf import settings
        from django.db import connection

        from durable.tasks import publishing

        settings.DURABLE = self._before
        publishing.TEMPLATES = publishing.DIRECT_WRITES = True
        if self._options is not None:
            try:  # the row measured what it says: the round's starts called a prepared durable_admit
                with connection.cursor() as cursor:
                    cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s", ["%durable_admit(%"])
                    (prepared,) = cursor.fetchone()
            finally:
                connection.close()
                connection.settings_dict["OPTIONS"], self._options = self._options, None
            if not prepared:
                raise RuntimeError("the round with prepared statements did not prepare the call of durable_admit")

    def start(self, key: str) -> bool:
        self.workflow.dispatch({"key": key})
        return True

    def finish(self) -> None:
        from durable import tasks

        if not tasks.publisher.flush(timeout=120):
            raise RuntimeError("the background publisher did not publish the round's messages within 120 s")

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


@functools.cache
def chat_input(key: str, size: int) -> dict[str, Any]:
    """A start's input as a chat turn sends it: the key and a history of messages, about
    ``size`` bytes of JSON (built once, the same object each call: as a view would pass its
    request's; the timed starts do not build it)."""
    turn = {"role": "user", "content": "How do I reset the password of a shared account? " * 4}
    count = max(1, size // len(json.dumps(turn)))
    return {"key": key, "history": [dict(turn) for _ in range(count)]}


class DurableStarter:
    """``Engine.start`` on a private registry, with a no-op dispatch."""

    def __init__(self, using: str = "default") -> None:
        from durable import Concurrency, DjangoStore, Engine
        from durable.runtime.registry import Registry

        self._concurrency = Concurrency
        self.engine = Engine(store=DjangoStore(using=using), dispatch=_no_dispatch, registry=Registry())
        self.engine.register(WORKFLOW, VERSION, _noop_body, Concurrency(key=key_of, limit=RATE_LIMIT))
        self.engine.register(ONE_STEP_WORKFLOW, VERSION, _one_step_body, Concurrency(key=key_of, limit=RATE_LIMIT))

    def set_hot_limit(self, limit: int) -> None:
        self.engine.register(HOT_WORKFLOW, VERSION, _noop_body, self._concurrency(key=key_of, limit=limit))

    def set_grr_limit(self, limit: int) -> None:
        from durable import Strategy

        concurrency = self._concurrency(key=key_of, limit=limit, strategy=Strategy.GROUP_ROUND_ROBIN)
        self.engine.register(GRR_WORKFLOW, VERSION, _noop_body, concurrency)

    def start_status(self, key: str, workflow: str = WORKFLOW) -> str:
        """Start one run; the status it was created with, or "refused"."""
        from durable.exceptions import ConcurrencyLimitError

        try:
            return str(self.engine.start(workflow, {"key": key}).status)
        except ConcurrencyLimitError:
            return "refused"

    def start(self, key: str, workflow: str = WORKFLOW, input_bytes: int = 0) -> bool:
        """Start one run; False when its quota refused it. ``input_bytes``: its input carries
        a chat history of about that many bytes of JSON (``chat_input``)."""
        from durable.exceptions import ConcurrencyLimitError

        try:
            self.engine.start(workflow, chat_input(key, input_bytes) if input_bytes else {"key": key})
        except ConcurrencyLimitError:
            return False
        return True

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


_SELECT_LOCK = 'SELECT "key", "limit", count_statuses FROM durable_concurrencylock WHERE "key" = %s FOR UPDATE'
_UPDATE_LOCK = 'UPDATE durable_concurrencylock SET "limit" = %s, count_statuses = %s WHERE "key" = %s'
_COUNT = "SELECT COUNT(*) FROM durable_runtag WHERE tag = %s AND status = ANY(%s)"


class _Insert:
    """A plain one-row ``INSERT`` of ``model`` in the columns Django's own insert sends."""

    def __init__(self, model: Any, explicit: Sequence[str], suffix: str = "") -> None:
        self.fields = schema.insert_fields(model, explicit)
        columns = ", ".join(schema.column(f) for f in self.fields)
        values = ", ".join(["%s"] * len(self.fields))
        self.sql = f"INSERT INTO {model._meta.db_table} ({columns}) VALUES ({values}){suffix}"
        self.defaults = {f.name: schema.default_param(f) for f in self.fields if f.name not in explicit}

    def params(self, **values: Any) -> list[Any]:
        return [values[f.name] if f.name in values else self.defaults[f.name] for f in self.fields]


class RawStarter:
    """Durable's admission transaction in plain psycopg 3 (one connection, psycopg defaults)."""

    def __init__(self, conninfo: str) -> None:
        from durable import models

        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.statuses = list(DEFAULT_CONCURRENCY_STATUSES)
        self.insert_lock = _Insert(models.ConcurrencyLock, ("key", "limit", "count_statuses"), " ON CONFLICT DO NOTHING")
        self.insert_run = _Insert(
            models.WorkflowRun,
            ("run_id", "workflow", "version", "namespace", "status", "input", "dispatched_at"),
            " RETURNING id",
        )
        self.insert_tag = _Insert(models.RunTag, ("run", "tag", "status", "namespace"))

    def start(self, key: str, limit: int = RATE_LIMIT) -> bool:
        """BEGIN; lock the key's row (creating it once); count; insert run and tag; COMMIT."""
        tag = "concurrency:" + key
        try:
            with self.conn.transaction(), self.conn.cursor() as cur:
                row = cur.execute(_SELECT_LOCK, (key,)).fetchone()
                if row is None:
                    lock = self.insert_lock.params(key=key, limit=limit, count_statuses=Jsonb(self.statuses))
                    cur.execute(self.insert_lock.sql, lock)
                    row = cur.execute(_SELECT_LOCK, (key,)).fetchone()
                assert row is not None
                if row[1] != limit or row[2] != self.statuses:
                    cur.execute(_UPDATE_LOCK, (limit, Jsonb(self.statuses), key))
                active = cur.execute(_COUNT, (tag, self.statuses)).fetchone()
                if active is None or active[0] >= limit:
                    raise _Refused
                run_params = self.insert_run.params(
                    run_id=uuid.uuid4().hex,
                    workflow=WORKFLOW,
                    version=VERSION,
                    namespace="default",
                    status="pending",
                    input=Jsonb({"key": key}),
                    dispatched_at=datetime.now(UTC),
                )
                run = cur.execute(self.insert_run.sql, run_params).fetchone()
                assert run is not None
                tag_params = self.insert_tag.params(run=run[0], tag=tag, status="pending", namespace="default")
                cur.execute(self.insert_tag.sql, tag_params)
        except _Refused:
            return False
        return True

    def close(self) -> None:
        self.conn.close()


def django_backend_pid() -> int:
    """The process id of the PostgreSQL backend serving Django's default connection."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


class RoundTrip:
    """``SELECT 1``, the cheapest statement there is: the floor under a refusal.

    ``via="django"`` sends it through Django's ``connection.cursor()``, the way
    durable's own statement goes; ``via="psycopg"`` on a bare psycopg connection.
    ``via="statement"`` sends instead the statement a refusal of ``key`` at ``limit``
    sends (``durable_full_key``, ``_refuse_if_full``'s), through Django's cursor,
    without durable's Python around it: the part of a refusal that is the database's.
    """

    def __init__(self, via: str, conninfo: str, key: str = "", limit: int = 0) -> None:
        if via not in ("django", "psycopg", "statement"):
            raise ValueError(f"unknown round trip {via!r}")
        self.conn = psycopg.connect(conninfo, autocommit=True) if via == "psycopg" else None
        self.sql, self.params = "SELECT 1", None
        if via == "statement":
            from durable.concurrency import DEFAULT_CONCURRENCY_STATUSES, Quota, Strategy
            from durable.stores.admitting import FULL_KEY_SQL, full_key_params

            quota = Quota(key, limit, tuple(DEFAULT_CONCURRENCY_STATUSES), Strategy.REJECT, None, None)
            self.sql, self.params = FULL_KEY_SQL, full_key_params(quota, None)

    def __call__(self) -> Any:
        """Send the statement; its row."""
        if self.conn is not None:
            return self.conn.execute("SELECT 1").fetchone()
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(self.sql, self.params)
            return cursor.fetchone()

    def backend_pid(self) -> int:
        """The process id of the PostgreSQL backend serving this round trip's connection."""
        return self.conn.info.backend_pid if self.conn is not None else django_backend_pid()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class _Refused(Exception):
    """Leaves the raw transaction (rolling it back) when the quota is full."""


class ProcrastinateStarter:
    """``defer()`` of a no-op task on a sync procrastinate app (``SyncPsycopgConnector``)."""

    def __init__(self, conninfo: str) -> None:
        import procrastinate

        self.app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=conninfo, min_size=1, max_size=1))
        self.task = self.app.task(name=JOB_NAME, queue=QUEUE)(_noop_job)
        self.app.open()

    def start(self, key: str) -> bool:
        self.task.defer(key=key)
        return True

    def close(self) -> None:
        self.app.close()


class DbosStarter:
    """``DBOSClient.enqueue()`` of a workflow onto a queue in DBOS's system database."""

    def __init__(self, url: str) -> None:
        from dbos import DBOSClient

        self.client = DBOSClient(system_database_url=url)
        self.options: Any = {"workflow_name": JOB_NAME, "queue_name": QUEUE}

    def start(self, key: str) -> bool:
        self.client.enqueue(self.options, key)
        return True

    def close(self) -> None:
        self.client.destroy()


def install_procrastinate(conninfo: str) -> str | None:
    """Apply procrastinate's schema to the scratch database; return why not, or None."""
    try:
        import procrastinate
    except ImportError as exc:
        return f"procrastinate is not installed ({exc}); pip install -e '.[bench]'"
    try:
        app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=conninfo, min_size=1, max_size=1))
        app.open()
        try:
            app.schema_manager.apply_schema()
        finally:
            app.close()
    except Exception as exc:
        return _why("applying procrastinate's schema failed", exc)
    return None


def install_dbos(url: str) -> str | None:
    """Create DBOS's system tables in their scratch database; return why not, or None."""
    try:
        from dbos import DBOS
    except ImportError as exc:
        return f"dbos is not installed ({exc}); pip install -e '.[bench]'"
    try:
        DBOS.migrate(url)
    except Exception as exc:
        return _why("migrating DBOS's system database failed", exc)
    return None


def _why(what: str, exc: BaseException) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return f"{what}: {last}"
