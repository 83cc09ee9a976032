"""``durable_end`` answers how many of the run's quota keys need a hand-off, not
how many it has: a key whose row lock the call takes (``SKIP LOCKED``, held until
the commit) and that has no queued run needs none, so the end of a run of a
REJECT key (or of a queueing key with an empty queue) is one round trip, without
the ``durable_promote`` that followed it. Workers of the previous release read
the answer as before (0: no hand-off), so a rolling deploy is safe either way.

Runs ``sql/migrations/0022_lifecycle.sql``; reversing runs 0019's file again.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0022_lifecycle.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0019_lifecycle.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0021_redundant_run_indexes")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
