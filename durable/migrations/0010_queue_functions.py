"""The PostgreSQL functions that make ``GROUP_ROUND_ROBIN`` one round trip per step:
``durable_admit_queued`` (the admission of a start whose quotas are REJECT and/or
GROUP_ROUND_ROBIN, queued or not) and ``durable_promote`` (handing the free slots
of keys to their queued runs).

Other databases use the generic path (``Engine._admit``, ``admission.Promoter``)
and get nothing here. This migration runs the functions as released with it
(``sql/migrations/0010_queue.sql``), never today's copy: later versions are
installed by later migrations.
"""

from pathlib import Path

from django.db import migrations

SQL = (Path(__file__).resolve().parent.parent / "sql" / "migrations" / "0010_queue.sql").read_text()
SIGNATURES = (
    "durable_admit_queued(jsonb, text, text, text, text, text, jsonb, text, text, boolean, jsonb)",
    "durable_promote(jsonb, text, text, jsonb, timestamptz, boolean)",
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SQL)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for signature in SIGNATURES:
            schema_editor.execute(f"DROP FUNCTION IF EXISTS {signature}")


class Migration(migrations.Migration):
    dependencies = [("durable", "0009_read_side_indexes")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
