"""Deleting finished runs: ``manage.py durable purge`` and the sweeper's ``RETENTION``.

A purge deletes runs in batches, each in a short transaction of its own that
reads one index range (``durable_run_finished_idx``: terminal status, then
``finished_at``), so it never holds locks for long. It touches nothing admission
waits on: never a ``ConcurrencyLock`` row, and only the tag rows of the finished
runs it deletes (admission counts the tag rows of in-flight statuses, a range of
the ``(tag, status)`` index the purge does not write). The batch's runs are
locked ``FOR UPDATE SKIP LOCKED`` (on PostgreSQL) and read again under the lock,
so a run retried meanwhile is left alone; so is a run with an unfinished child,
and a run a quota still counts (a lifetime cap: a key counting finished statuses).

The children rows (tags, steps, signals) are deleted with one ``DELETE ... IN``
per table and batch, not collected in Python the way ``QuerySet.delete()`` does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from time import monotonic, sleep
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, models, transaction
from django.db.models import Exists, OuterRef, Q

from durable.concurrency import TAG_PREFIX
from durable.conf import settings
from durable.status import ACTIVE_STATUSES, RunStatus

#: The statuses a purge may delete, in the order a purge goes through them.
PURGEABLE_STATUSES: tuple[str, ...] = (RunStatus.COMPLETED, RunStatus.CANCELLED, RunStatus.FAILED, RunStatus.DEAD)
#: Runs per batch of ``manage.py durable purge`` (``--batch-size``).
BATCH_SIZE = 5000
#: After each batch, ``manage.py durable purge`` pauses this many times as long as
#: the batch took (``--pause-factor``): 1.0 leaves the database at least half of the
#: time to the work it is doing anyway (starts, steps), for twice the purge's duration.
PAUSE_FACTOR = 1.0
#: At most this many runs are deleted by one sweep under ``RETENTION``, so a sweep stays short.
SWEEP_BATCH_SIZE = 1000
#: The longest duration accepted (100 years): beyond it the cutoff is not a date.
_MAX_DAYS = 36500

_DURATION = re.compile(r"(\d+)([dhms])")
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
DURATION_HELP = "a whole number followed by d, h, m or s (30d, 12h, 90m, 45s)"


def parse_duration(text: Any) -> timedelta:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"`` as a ``timedelta``; ``ValueError`` otherwise."""
    match = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a duration: write {DURATION_HELP}.")
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds > _MAX_DAYS * 86400:
        raise ValueError(f"{text!r} is longer than {_MAX_DAYS} days.")
    return timedelta(seconds=seconds)


def retention_policy(value: Any = None, *, from_settings: bool = True) -> dict[str, timedelta]:
    """``DURABLE["RETENTION"]`` as ``{status: age}``: a finished run of ``status``
    is deleted once it finished longer than ``age`` ago. ``{}`` when retention is off.

    The setting is ``None`` (keep every run), one duration for every finished
    status (``"30d"``), or a dictionary by status (``{"completed": "7d",
    "failed": "90d"}``; a status left out, or given ``None``, is kept). Raises
    ``ImproperlyConfigured`` saying what is wrong (system check ``durable.E004``).
    """
    if from_settings:
        value = settings.RETENTION
    if value is None:
        return {}
    try:
        if isinstance(value, str):
            age = parse_duration(value)
            return dict.fromkeys(PURGEABLE_STATUSES, age)
        if not isinstance(value, Mapping):
            raise ValueError(f"it must be None, a duration such as '30d' or a dictionary by status, got {value!r}")
        unknown = sorted(str(s) for s in value if s not in PURGEABLE_STATUSES)
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))} is not a finished status (use {', '.join(PURGEABLE_STATUSES)})")
        return {status: parse_duration(value[status]) for status in PURGEABLE_STATUSES if value.get(status) is not None}
    except ValueError as exc:
        raise ImproperlyConfigured(f"DURABLE['RETENTION'] is invalid: {exc}") from None


# -- queries --------------------------------------------------------------------------


def _models() -> Any:
    # Imported lazily: the sweeper's modules are imported before the app registry is ready.
    from durable import models as durable_models

    return durable_models


def purgeable(status: str, before: datetime, *, using: str = "default", namespace: str | None = None) -> models.QuerySet:
    """Runs of a finished ``status`` that finished before ``before`` (a range of
    ``durable_run_finished_idx``): what a purge deletes, but for those with an
    unfinished child (``with_unfinished_children``)."""
    if status not in PURGEABLE_STATUSES:
        raise ValueError(f"Only finished runs can be purged, not {status!r} ones.")
    qs = _models().WorkflowRun._base_manager.using(using).filter(status=status, finished_at__lt=before)
    return qs if namespace is None else qs.filter(namespace=namespace)


def with_unfinished_children(ids: Sequence[int], *, using: str = "default") -> set[int]:
    """Which of the runs ``ids`` have a child that has not finished (kept by a purge).

    A query of its own rather than a ``NOT EXISTS`` in the batch's: that one's plan
    depends on how many runs are in flight, this one reads ``ids``' children only."""
    connection = connections[using]
    table = connection.ops.quote_name(_models().WorkflowRun._meta.db_table)
    within, params = _within(connection, ids)
    statuses = ", ".join(["%s"] * len(ACTIVE_STATUSES))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT DISTINCT parent_id FROM {table} WHERE parent_id {within} AND status IN ({statuses})",
            [*params, *ACTIVE_STATUSES],
        )
        return {row[0] for row in cursor.fetchall()}


def still_counted(ids: Sequence[int], *, using: str = "default") -> set[int]:
    """Which of the finished runs ``ids`` a quota still counts (kept by a purge): a
    key whose ``count_statuses`` include the run's finished status, a lifetime cap
    such as ``["pending", "running", "completed"]``. Deleting such a run would give
    its key a slot back. One read of the batch's quota tags, one of their keys' rows."""
    models_ = _models()
    tags = list(
        models_.RunTag.objects.using(using)
        .filter(run_id__in=ids, tag__startswith=TAG_PREFIX)
        .values_list("run_id", "tag", "status")
    )
    if not tags:
        return set()
    keys = {tag[len(TAG_PREFIX) :] for _, tag, _ in tags}
    counted = dict(models_.ConcurrencyLock.objects.using(using).filter(key__in=keys).values_list("key", "count_statuses"))
    return {run_id for run_id, tag, status in tags if status in (counted.get(tag[len(TAG_PREFIX) :]) or ())}


def _within(connection: Any, ids: Sequence[int]) -> tuple[str, list[Any]]:
    """``column <this>`` matches ``ids``: one array parameter on PostgreSQL (planned
    the same whatever the batch size), a list of parameters elsewhere."""
    if connection.vendor == "postgresql":
        return "= ANY(%s)", [list(ids)]
    return f"IN ({', '.join(['%s'] * len(ids))})", list(ids)


def count_purgeable(before: Mapping[str, datetime], *, using: str = "default", namespace: str | None = None) -> dict[str, int]:
    """How many runs a purge with these cutoffs (``{status: finished before}``) would
    delete, by status: those it keeps (an unfinished child, counted by a quota) left out."""
    runs = _models().WorkflowRun._base_manager.using(using)
    counts = {}
    for status, cutoff in before.items():
        unfinished_child = runs.filter(status__in=ACTIVE_STATUSES, parent_id=OuterRef("pk"))
        found = purgeable(status, cutoff, using=using, namespace=namespace).filter(~Exists(unfinished_child))
        counting = [TAG_PREFIX + key for key in _keys_counting(status, using)]
        if counting:
            found = found.exclude(tags__tag__in=counting)
        counts[status] = found.count()
    return counts


def _keys_counting(status: str, using: str) -> list[str]:
    """The keys whose quota counts the finished ``status`` (lifetime caps; usually none)."""
    rows = _models().ConcurrencyLock.objects.using(using).values_list("key", "count_statuses")
    return [key for key, statuses in rows.iterator() if status in (statuses or ())]


#: Where a purge of one status stands: the (finished_at, id) of the last run it read.
Cursor = tuple[datetime, int]


def purge_batch(
    status: str,
    before: datetime,
    *,
    limit: int,
    using: str = "default",
    namespace: str | None = None,
    after: Cursor | None = None,
) -> tuple[list[str], Cursor | None]:
    """Delete up to ``limit`` purgeable runs of ``status`` (oldest finished first,
    from ``after`` on) in one transaction; return their run ids and the cursor of
    the next batch (None: none left)."""
    connection = connections[using]
    # A list of parameters per statement off PostgreSQL: at most what the database takes (999 on SQLite).
    limit = min(limit, connection.features.max_query_params or limit) if connection.vendor != "postgresql" else limit
    with transaction.atomic(using=using):
        qs = purgeable(status, before, using=using, namespace=namespace).order_by("finished_at", "id")
        if after is not None:
            # The range starts at the cursor (an index condition); the rows of its
            # instant that were read already are filtered out.
            qs = qs.filter(finished_at__gte=after[0]).filter(Q(finished_at__gt=after[0]) | Q(id__gt=after[1]))
        if connection.features.has_select_for_update_skip_locked:
            # A run being retried or read for update is left for a later purge.
            qs = qs.select_for_update(skip_locked=True, of=("self",))
        rows = list(qs.values_list("id", "run_id", "finished_at")[:limit])
        if not rows:
            return [], None
        ids = [row[0] for row in rows]
        kept = with_unfinished_children(ids, using=using) | still_counted(ids, using=using)
        doomed = [row for row in rows if row[0] not in kept]
        if doomed:
            _delete(using, [row[0] for row in doomed])
    cursor = (rows[-1][2], rows[-1][0]) if len(rows) == limit else None
    return [row[1] for row in doomed], cursor


def _delete(using: str, ids: Sequence[int]) -> None:
    """Delete the runs ``ids`` (locked by the caller) and what refers to them."""
    run = _models().WorkflowRun
    connection = connections[using]
    quote = connection.ops.quote_name
    within, params = _within(connection, ids)
    with connection.cursor() as cursor:
        for relation in run._meta.related_objects:
            model, field = relation.related_model, relation.field
            table, column = quote(model._meta.db_table), quote(field.column)
            on_delete = relation.on_delete
            if model is run or on_delete is models.SET_NULL:
                # A finished child of a purged parent stays, without its parent.
                cursor.execute(f"UPDATE {table} SET {column} = NULL WHERE {column} {within}", params)
            elif on_delete is models.CASCADE and model._meta.app_label == "durable":
                cursor.execute(f"DELETE FROM {table} WHERE {column} {within}", params)
            elif on_delete is models.CASCADE:
                # A project's own model: Django's collector follows its relations.
                model._base_manager.using(using).filter(**{f"{field.name}__in": ids}).delete()
            elif on_delete is not models.DO_NOTHING:
                raise ImproperlyConfigured(
                    f"{model._meta.label}.{field.name} refers to workflow runs with on_delete={on_delete.__name__}: "
                    "durable's purge deletes runs only when what refers to them cascades, is set null or does nothing."
                )
        cursor.execute(f"DELETE FROM {quote(run._meta.db_table)} WHERE id {within}", params)


def purge(
    before: Mapping[str, datetime],
    *,
    using: str = "default",
    namespace: str | None = None,
    batch_size: int = BATCH_SIZE,
    pause_factor: float = 0.0,
    on_batch: Callable[[str, int], None] | None = None,
) -> dict[str, int]:
    """Delete every purgeable run (``before``: ``{status: finished before}``) in
    batches of ``batch_size``; ``on_batch(status, deleted)`` after each batch, then
    a pause of ``pause_factor`` times the time the batch took (no transaction open).
    Returns how many runs were deleted, by status."""
    deleted: dict[str, int] = {}
    for status, cutoff in before.items():
        deleted[status] = 0
        cursor: Cursor | None = None
        while True:
            began = monotonic()
            run_ids, cursor = purge_batch(status, cutoff, limit=batch_size, using=using, namespace=namespace, after=cursor)
            took = monotonic() - began
            deleted[status] += len(run_ids)
            if on_batch is not None and run_ids:
                on_batch(status, len(run_ids))
            if cursor is None:
                break
            if pause_factor > 0:
                sleep(took * pause_factor)
    return deleted


def expired(now: datetime, policy: Mapping[str, timedelta]) -> dict[str, datetime]:
    """The cutoffs of ``policy`` at ``now``: ``{status: finished before}``."""
    return {status: now - age for status, age in policy.items()}


def purge_some(before: Mapping[str, datetime], *, limit: int, using: str = "default") -> list[str]:
    """One bounded batch across statuses (the sweeper's): at most ``limit`` runs in all,
    oldest finished first within each status."""
    purged: list[str] = []
    for status in before:
        if len(purged) >= limit:
            break
        run_ids, _ = purge_batch(status, before[status], limit=limit - len(purged), using=using)
        purged += run_ids
    return purged
