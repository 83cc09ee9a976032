"""``durable_admit_queued`` decides the queue-depth strategies too
(``CANCEL_QUEUED_EXCEPT_NEWEST`` / ``_OLDEST``) in its one round trip: a start on a
full queue is created cancelled, or cancels the oldest queued runs of the key,
under the key's lock. Its result gains ``run_error``, ``run_finished_at`` and
``superseded``.

Runs ``sql/migrations/0015_queue.sql``; reversing runs ``0012_queue.sql`` again
(which drops this version first: the arguments are the same).
"""

from pathlib import Path

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "sql" / "migrations" / "0015_queue.sql"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SQL.read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL.parent / "0012_queue.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0014_lifecycle_end")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
