"""``durable_admit`` refuses more cheaply: before recording a refused start's
limits it checks whether any key's row holds other ones, so the usual refusal
(one more start over the same limit) runs no UPDATE statement at all. What is
written is unchanged: rows whose limits differ, never waiting for a locked one.

Runs ``sql/migrations/0011_admit_refusal.sql``; reversing runs 0006's file again
(the signature is unchanged).
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0011_admit_refusal.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0006_admit_restart.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0010_queue_functions")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
