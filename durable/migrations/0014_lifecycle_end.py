"""``durable_end``: the finish of an execution (``durable_finish`` as 0012 left
it, recording durations) that also answers how many quota keys the run held, so
a run without any skips the hand-off call that would find nothing to hand on (a
one-step run is then three round trips, not four). ``durable_finish`` stays, for
workers of the previous release while a deploy rolls, as ``durable_end``'s answer
read as a boolean.

Runs ``sql/migrations/0014_lifecycle.sql``; reversing installs 0012's
``durable_finish`` again, then drops ``durable_end``.
"""

from pathlib import Path

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "sql" / "migrations" / "0014_lifecycle.sql"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SQL.read_text())


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL.parent / "0012_lifecycle.sql").read_text())  # durable_finish without durable_end
        schema_editor.execute("DROP FUNCTION IF EXISTS durable_end(text, text, text, jsonb, jsonb, timestamptz)")


class Migration(migrations.Migration):
    dependencies = [("durable", "0013_finished_index")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
