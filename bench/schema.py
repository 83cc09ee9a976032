"""Durable's tables as the benchmark's hand-written SQL sees them, read from the models.

The raw baseline and the bulk loader insert into durable's tables without the
ORM; they take the column lists from the models here, so they follow schema
changes and send the same columns as Django's own insert: every concrete field
except the auto primary key and the fields with a database default, the ones a
statement does not set getting the field's Python default.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from psycopg.types.json import Jsonb


def insert_fields(model: Any, explicit: Collection[str]) -> list[Any]:
    """The fields an insert of ``model`` sends, ``explicit`` (field names) included."""
    return [f for f in model._meta.concrete_fields if f.name in explicit or not (f.primary_key or f.has_db_default())]


def default_param(field: Any) -> Any:
    """The field's Python default as a psycopg parameter."""
    from django.db import models

    value = field.get_default()
    return Jsonb(value) if isinstance(field, models.JSONField) and value is not None else value


def column(field: Any) -> str:
    return '"' + str(field.column).replace('"', '""') + '"'
