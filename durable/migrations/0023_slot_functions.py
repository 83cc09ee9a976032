"""A step-level quota's slot taken (``durable_acquire_slot``), or given back with its
hand-off and the wake-up of the run handed it (``durable_release_slot``), in one
round trip on PostgreSQL, instead of ``DjangoStore``'s ORM sequences (lock, read
the run and the step's row, read the waiters, count, grant or park, commit; then
the wake-up's own transaction); ``durable_slot_hand_off`` and ``durable_slots_held``
are their shared parts.

Runs ``sql/migrations/0023_slots.sql``; reversing drops the four functions (the
ORM paths before them need none).
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0023_slots.sql").read_text())


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "DROP FUNCTION IF EXISTS durable_release_slot(text, integer, text, text, timestamp with time zone, text[], text[], boolean);"
            "DROP FUNCTION IF EXISTS durable_acquire_slot("
            "text, text, integer, text, integer, boolean, timestamp with time zone, text[], text[]);"
            "DROP FUNCTION IF EXISTS durable_slot_hand_off(text, integer, timestamp with time zone, text[], text[]);"
            "DROP FUNCTION IF EXISTS durable_slots_held(text, text[]);"
        )


class Migration(migrations.Migration):
    dependencies = [("durable", "0022_lifecycle_end_hand_off")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
