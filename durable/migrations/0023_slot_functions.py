"""A step-level quota's release, hand-off and the wake-up of the run handed the
slot in one round trip on PostgreSQL: ``durable_release_slot`` and
``durable_slot_hand_off``, which ``DjangoStore`` calls instead of its ORM sequence
(lock, delete, read the waiters, count, grant, commit; then the wake-up's own
transaction).

Runs ``sql/migrations/0023_slots.sql``; reversing drops the two functions (the
ORM path of the release before them needs none).
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
            "DROP FUNCTION IF EXISTS durable_slot_hand_off(text, integer, timestamp with time zone, text[], text[]);"
        )


class Migration(migrations.Migration):
    dependencies = [("durable", "0022_lifecycle_end_hand_off")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
