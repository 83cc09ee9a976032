"""A cheaper refusal: runs ``sql/migrations/0024_admit.sql``.

``durable_admit``'s first count of a key (made without any lock) now also reads
the key's row (its override, the limits recorded on it and its recent
durations) and the age of its oldest run in flight, in the same statement. A
start refused there, the usual refusal of a storm on a hot key, runs no other
statement; it ran four more: the statuses' array, a loop over the keys comparing
each key's row with the start's limits (two statements), and the Retry-After
estimate. The function's
signature, columns and answers are unchanged. Reversing runs 0018's file again.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0024_admit.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0018_admit.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0023_slot_functions")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
