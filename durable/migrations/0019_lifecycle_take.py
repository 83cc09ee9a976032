"""``durable_take``: the claim of an execution, as ``durable_claim`` was, that may
commit without waiting for the disk when it is a transaction of its own and losing
it cannot change a quota's count (every key of the run counts ``pending`` and
``blocked`` wherever it counts ``running``, as the default statuses do): a claim
lost in a crash of the database only executes the run again from its journal.
``durable_claim`` stays, for workers of the previous release while a deploy
rolls, as ``durable_take`` committing synchronously.

Runs ``sql/migrations/0019_lifecycle.sql``; reversing runs 0014's file again
(``durable_claim`` as it was), then drops ``durable_take``.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0019_lifecycle.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0014_lifecycle.sql").read_text())
        schema_editor.execute("DROP FUNCTION IF EXISTS durable_take(text, text, text, timestamptz, timestamptz, boolean)")


class Migration(migrations.Migration):
    dependencies = [("durable", "0018_burst_admit")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
