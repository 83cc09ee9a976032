"""The benchmark's throw-away databases, on the server of Django's ``default`` alias.

``scratch_databases()`` creates the main one with Django's test-database machinery
(``create_test_db``: a fresh database, all migrations), copies it for the extra
durable databases (``CREATE DATABASE ... TEMPLATE``), creates the empty ones, and
drops them all when the block ends, also on error or Ctrl-C. The project's own
database is never written to: every name is checked against it first.
"""

from __future__ import annotations

import contextlib
import logging
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection
from psycopg import conninfo as _conninfo
from psycopg import errors, sql

logger = logging.getLogger(__name__)


class ScratchError(Exception):
    """A scratch database could not be created."""


@dataclass
class Scratch:
    """Names of the scratch databases and how to reach their server."""

    main: str
    copies: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)

    def conninfo(self, dbname: str) -> str:
        return _conninfo.make_conninfo("", dbname=dbname, **self.params)

    def url(self, dbname: str) -> str:
        """A ``postgresql://`` URL (for SQLAlchemy-based DBOS)."""
        user = urllib.parse.quote(str(self.params.get("user", "")), safe="")
        password = self.params.get("password")
        auth = f"{user}:{urllib.parse.quote(str(password), safe='')}@" if password else (f"{user}@" if user else "")
        host = self.params.get("host", "localhost")
        port = f":{self.params['port']}" if self.params.get("port") else ""
        return f"postgresql://{auth}{host}{port}/{urllib.parse.quote(dbname, safe='')}"


def server_params() -> dict[str, Any]:
    """host/port/user/password of the ``default`` alias, as psycopg keywords."""
    d = connection.settings_dict
    params = {"host": d.get("HOST"), "port": d.get("PORT"), "user": d.get("USER"), "password": d.get("PASSWORD")}
    return {k: str(v) for k, v in params.items() if v not in (None, "")}


@contextlib.contextmanager
def scratch_databases(main: str, *, copies: Sequence[str] = (), empty: Sequence[str] = ()) -> Iterator[Scratch]:
    """Create ``main`` (migrated), ``copies`` of it and ``empty`` databases; drop all at exit.

    While the block runs, Django's ``default`` alias points at ``main``.
    """
    real_name = str(connection.settings_dict["NAME"])
    names = [main, *copies, *empty]
    for name in names:
        if name == real_name or name in ("postgres", "template0", "template1"):
            raise ScratchError(
                f"Refusing to use {name!r} as a scratch database: it is the project's database "
                "or a system one. Pick another name with --db-name."
            )
    if len(set(names)) != len(names):
        raise ScratchError(f"Scratch database names must differ: {names}.")
    scratch = Scratch(main=main, params=server_params())
    connection.settings_dict.setdefault("TEST", {})["NAME"] = main
    try:
        connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
        connection.close()
        for name in copies:
            _create(scratch, name, template=main)
            scratch.copies.append(name)
        for name in empty:
            _create(scratch, name)
            scratch.empty.append(name)
        yield scratch
    finally:
        connection.close()
        for name in [*scratch.empty, *scratch.copies]:
            _drop(scratch, name)
        _drop_main(scratch, real_name)


def add_copy(scratch: Scratch, name: str) -> None:
    """Copy the main scratch database (no session may be connected to it) into
    ``name``, which is then dropped with the others at the end."""
    if name in (scratch.main, *scratch.copies, *scratch.empty):
        raise ScratchError(f"Scratch database names must differ: {name!r} is taken.")
    _create(scratch, name, template=scratch.main)
    scratch.copies.append(name)


def _maintenance(scratch: Scratch) -> psycopg.Connection[Any]:
    return psycopg.connect(scratch.conninfo("postgres"), autocommit=True)


def _create(scratch: Scratch, name: str, template: str | None = None) -> None:
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        statement = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
    with _maintenance(scratch) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        for attempt in range(20):
            try:
                conn.execute(statement)
                return
            except errors.ObjectInUse as exc:
                # The template still has a session (a connection closing, autovacuum).
                if attempt == 19:
                    raise ScratchError(f"Could not copy {template!r} into {name!r}: {exc}") from exc
                time.sleep(0.25)


def _drop(scratch: Scratch, name: str) -> None:
    try:
        with _maintenance(scratch) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    except psycopg.Error:
        logger.exception("Could not drop the scratch database %s; drop it by hand.", name)


def _drop_main(scratch: Scratch, real_name: str) -> None:
    """Drop the main scratch database and point ``default`` back at the project's database."""
    if connection.settings_dict["NAME"] == scratch.main:
        try:
            connection.creation.destroy_test_db(real_name, verbosity=0)
        except Exception:
            logger.warning("destroy_test_db failed; forcing the drop of %s.", scratch.main, exc_info=True)
    # Whatever happened above, never leave the alias on the scratch name.
    settings.DATABASES[connection.alias]["NAME"] = real_name
    connection.settings_dict["NAME"] = real_name
    _drop(scratch, scratch.main)
