"""What keeps the admin's lists as fast with a million rows as with a thousand:
a paginator that does not count a big table, and list filters whose choices are
read by skipping through an index rather than scanning the table."""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Field, Model, QuerySet

#: Up to this many rows (by the planner's estimate), a list's count is exact.
EXACT_COUNT_UP_TO = 10_000


class EstimatedCountPaginator(Paginator):
    """A paginator whose count is the planner's row estimate for a big list on PostgreSQL.

    The admin's changelist asks its paginator for the count of the (filtered) list
    on every page: ``COUNT(*)`` reads every matching row, a million of them for an
    unfiltered run list. Here the count is exact while the planner expects at most
    ``EXACT_COUNT_UP_TO`` rows (a filter to the running runs, a small table), and
    the planner's estimate (``EXPLAIN``, from the table's statistics) above that:
    the page links are then approximate, the pages themselves exact. Elsewhere
    than on PostgreSQL it is Django's paginator.
    """

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet) and connections[queryset.db].vendor == "postgresql":
            estimate = _planner_rows(queryset)
            if estimate is not None and estimate > EXACT_COUNT_UP_TO:
                return estimate
        return int(super().count)


def _planner_rows(queryset: QuerySet[Any]) -> int | None:
    """The number of rows PostgreSQL's planner expects ``queryset`` to return."""
    sql, params = queryset.order_by().query.sql_with_params()
    with connections[queryset.db].cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        row = cursor.fetchone()
    if row is None:
        return None
    plan = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    try:
        return int(plan[0]["Plan"]["Plan Rows"])
    except (LookupError, TypeError, ValueError):
        return None


def distinct_values(model: type[Model], field: Field[Any, Any]) -> list[Any]:
    """The distinct non-null values of ``field`` in ``model``'s table, sorted.

    On PostgreSQL a recursive query jumps from one value to the next through an
    index that starts with the column (one short index descent per value), so
    it reads as many index entries as there are values, not rows. Elsewhere it
    is ``SELECT DISTINCT``.
    """
    manager = model._default_manager
    if connections[manager.db].vendor != "postgresql":
        values = manager.exclude(**{f"{field.name}__isnull": True}).order_by(field.name)
        return list(values.values_list(field.name, flat=True).distinct())
    quote = connections[manager.db].ops.quote_name
    table, column = quote(model._meta.db_table), quote(str(field.column))
    sql = (
        f"WITH RECURSIVE v(x) AS ("
        f"(SELECT {column} FROM {table} WHERE {column} IS NOT NULL ORDER BY {column} LIMIT 1) "
        f"UNION ALL SELECT (SELECT {column} FROM {table} WHERE {column} > v.x ORDER BY {column} LIMIT 1) "
        f"FROM v WHERE v.x IS NOT NULL) SELECT x FROM v WHERE x IS NOT NULL"
    )
    with connections[manager.db].cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]


class IndexedValuesFilter(admin.AllValuesFieldListFilter):
    """Django's "all values" list filter, its choices read by ``distinct_values``.

    For a column of the model itself whose values fill the choices (the runs'
    workflow and namespace, each the first column of an index).
    """

    def __init__(
        self,
        field: Field[Any, Any],
        request: Any,
        params: dict[str, list[str]],
        model: type[Model],
        model_admin: Any,
        field_path: str,
    ) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        self.lookup_choices = distinct_values(model, field)  # type: ignore[assignment]
