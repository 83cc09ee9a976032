"""The PostgreSQL functions that make each state change of an execution one round
trip: ``durable_claim`` (the claim and the journal read), ``durable_record_step``
(a journal write with its heartbeat and lease check) and ``durable_finish``.

Other databases use the ORM path of ``DjangoStore`` and get nothing here. This
migration runs the functions as released with it (``sql/migrations/0008_lifecycle.sql``),
never today's copy: later versions are installed by later migrations.
"""

from pathlib import Path

from django.db import migrations

SQL = (Path(__file__).resolve().parent.parent / "sql" / "migrations" / "0008_lifecycle.sql").read_text()
SIGNATURES = (
    "durable_claim(text, text, text, timestamptz, timestamptz)",
    "durable_record_step(text, text, integer, text, text, jsonb, jsonb, integer, timestamptz, timestamptz)",
    "durable_finish(text, text, text, jsonb, jsonb, timestamptz)",
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SQL)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for signature in SIGNATURES:
            schema_editor.execute(f"DROP FUNCTION IF EXISTS {signature}")


class Migration(migrations.Migration):
    dependencies = [("durable", "0007_unbounded_groups")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
