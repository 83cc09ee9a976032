"""``durable_full_key`` (``sql/migrations/0029_admit.sql``): the refusal of a start
of one key by its committed count, as one plain query, for a key whose last start
in the process was refused; ``durable_admit`` is unchanged.

Reversing runs 0028's file again and drops the function.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0029_admit.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0028_admit.sql").read_text())
        schema_editor.execute("DROP FUNCTION IF EXISTS durable_full_key(text, integer, jsonb, text)")


class Migration(migrations.Migration):
    dependencies = [("durable", "0028_admit_refusal_one_query")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
