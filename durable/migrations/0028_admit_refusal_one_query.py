"""``durable_admit`` refuses a start of one key with one query
(``sql/migrations/0028_admit.sql``): the count that refuses it before any lock
also reads what the refusal answers and records (the key row's limits, its
recent durations, the age of the oldest run counted), where the refusal ran
two more queries for them. Its signature and results are unchanged
(docs/explanation/quotas.md).

Reversing runs 0026's file again.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0028_admit.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0026_admit.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0027_end_locks_by_key")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
