"""``durable_admit`` gives the same answers with fewer queries
(``sql/migrations/0026_admit.sql``): it walks the quotas by index and reads each
quota's statuses with the new ``durable_statuses`` (simple expressions, where a
``FOR ... IN SELECT`` and an ``ARRAY(SELECT ...)`` each ran a query inside the
function), reads a locked key row's limits with its lock and updates them only
when they differ, and returns with ``RETURN NEXT``. A start of one key asked to (``"lock_first"``, which
``DjangoStore.admit`` sends unless the key's last start in the process was
refused) takes the key's row first when no one holds it, and counts once, under
the lock. Its signature and results are unchanged (docs/explanation/quotas.md).

Reversing runs 0025's file again and drops ``durable_statuses``.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0026_admit.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0025_admit.sql").read_text())
        schema_editor.execute("DROP FUNCTION IF EXISTS durable_statuses(jsonb);")


class Migration(migrations.Migration):
    dependencies = [("durable", "0025_counted_tags")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
