"""A key's count reads no finished run of the key: ``durable_counted_tags``
(``sql/migrations/0025_counting.sql``) returns the tag rows a quota counts, reading
the partial index of migration 0024 when the statuses counted are among the
default ``count_statuses``; ``durable_admit`` (``0025_admit.sql``),
``durable_admit_queued`` and ``durable_promote`` (``0025_queue.sql``) count through
it. Before, their generic plans read every tag entry of the key at each count,
finished runs included. The functions' signatures and results are unchanged.

Reversing runs 0018's and 0015's files again and drops ``durable_counted_tags``.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in ("0025_counting.sql", "0025_admit.sql", "0025_queue.sql"):
            schema_editor.execute((SQL_DIR / name).read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in ("0018_admit.sql", "0015_queue.sql"):
            schema_editor.execute((SQL_DIR / name).read_text())
        schema_editor.execute("DROP FUNCTION IF EXISTS durable_counted_tags(text[], text[], text);")


class Migration(migrations.Migration):
    dependencies = [("durable", "0024_tag_slot_index")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
