"""Connections a worker thread keeps across executions, for durable's own
statements of a run's lifecycle on PostgreSQL.

Celery's Django fix-up (``celery.fixups.django``) closes every Django
connection before and after every task, whatever ``CONN_MAX_AGE`` says. With
Django's connection, a worker would open a new PostgreSQL backend for every run
it executes: the connection, then a new backend's first statements (the catalog
entries of durable's tables, the planning of its PL/pgSQL functions), about
12 ms against about 1 ms on a connection already used.

Inside ``kept()`` (``durable.tasks``' ``execute_run`` and ``wake_run`` enter it,
see ``BaseStore.keep_connection``), durable's statements run on a connection of the
thread's own instead: the lifecycle's SQL functions (claim, lease checks, journal
writes, finish, hand-off to queued runs) are sent to it directly
(``ORMStore._lifecycle``), and the store's ORM calls (suspension, signals, step
slots, child starts, wake-ups) find it as ``connections[alias]`` for their length
(``serving``, through ``durable.stores.orm.kept_connection``). It is opened
on first use with the settings of the store's alias, without ``CONN_MAX_AGE``
and without a pool, and kept until the worker shuts down (``close_all``).
Django's connection stays what the workflow's own queries use, and what
durable's statements use inside a transaction of the caller's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

_local = threading.local()
_lock = threading.Lock()
#: The kept connections of every thread of this process, to close as the worker shuts down.
_threads: weakref.WeakSet[_Thread] = weakref.WeakSet()
#: A forked child's copies of its parent's kept connections: never closed or
#: collected in the child (that would end the parent's sessions).
_inherited: list[Any] = []


class _Thread:
    """One thread's kept connections, by alias. Closed when the thread ends (its
    ``threading.local`` lets go of this object, which holds no cycle, so at once):
    a Django connection is only collected by the cycle collector, later."""

    __slots__ = ("__weakref__", "finalizer", "wrappers")

    def __init__(self) -> None:
        self.wrappers: dict[str, BaseDatabaseWrapper] = {}
        self.finalizer = weakref.finalize(self, _close, self.wrappers)


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Lifecycle statements of this thread use its kept connections meanwhile."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def active() -> bool:
    """Whether this thread is inside ``kept()``."""
    return bool(getattr(_local, "depth", 0))


def chosen(alias: str) -> BaseDatabaseWrapper | None:
    """The connection durable's statements to ``alias`` take now, when it is the
    thread's kept one: inside ``kept()``, on PostgreSQL, while ``connections[alias]``
    is not in a transaction (the statements then belong to it). Else None."""
    current = connections[alias]
    if current.vendor != "postgresql" or current.in_atomic_block:
        return None
    return connection(alias)


@contextlib.contextmanager
def serving(alias: str) -> Iterator[None]:
    """Meanwhile ``connections[alias]`` is, for this thread, the connection ``chosen``
    gives, so durable's ORM statements run on it (a store's method decorated with
    ``durable.stores.orm.kept_connection``)."""
    django = connections[alias]
    wrapper = chosen(alias)
    if wrapper is None or wrapper is django:
        yield
        return
    connections[alias] = wrapper
    try:
        yield
    finally:
        connections[alias] = django


def connection(alias: str) -> BaseDatabaseWrapper | None:
    """This thread's kept connection to ``alias`` inside ``kept()``; None outside."""
    if not active():
        return None
    thread = getattr(_local, "thread", None)
    if thread is None:
        thread = _local.thread = _Thread()
        with _lock:
            _threads.add(thread)
    wrapper = thread.wrappers.get(alias)
    if wrapper is None:
        wrapper = thread.wrappers[alias] = _new(alias)
    return wrapper


def _new(alias: str) -> BaseDatabaseWrapper:
    """A Django connection to ``alias``'s database that nothing closes but durable:
    outside Django's ``connections`` (which Celery closes around every task; ``serving``
    puts it there only for the length of a store call), kept
    for good (``CONN_MAX_AGE`` None) and without a pool (Celery closes the pool of a
    prefork child around every task)."""
    django = connections[alias]
    options = {name: value for name, value in (django.settings_dict.get("OPTIONS") or {}).items() if name != "pool"}
    settings_dict = {**django.settings_dict, "CONN_MAX_AGE": None, "CONN_HEALTH_CHECKS": False, "OPTIONS": options}
    return type(django)(settings_dict, alias)


def recover(alias: str) -> None:
    """Close this thread's kept connection to ``alias`` if an error left it unusable
    (the next statement opens a new one)."""
    thread = getattr(_local, "thread", None)
    wrapper = None if thread is None else thread.wrappers.get(alias)
    if wrapper is not None:
        wrapper.close_if_unusable_or_obsolete()


def close_all() -> None:
    """Close every kept connection of this process (a worker shutting down)."""
    with _lock:
        threads = list(_threads)
    for thread in threads:
        _close(thread.wrappers)


def _close(wrappers: dict[str, BaseDatabaseWrapper]) -> None:
    for wrapper in list(wrappers.values()):
        wrapper.inc_thread_sharing()  # closed from another thread: the one stopping the worker
        try:
            with contextlib.suppress(Exception):  # a broken connection is gone already
                wrapper.close()
        finally:
            wrapper.dec_thread_sharing()


def _after_fork() -> None:
    global _local, _lock, _threads
    for thread in list(_threads):
        thread.finalizer.detach()  # the parent's connections: not the child's to close
        _inherited.append(thread)
    _local, _lock, _threads = threading.local(), threading.Lock(), weakref.WeakSet()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
