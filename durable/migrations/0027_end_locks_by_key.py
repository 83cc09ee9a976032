"""``durable_end`` locks and samples its run's quota keys one at a time, by key
(``sql/migrations/0027_lifecycle.sql``). In 0022 one statement joined the run's
tags with the keys' rows, and its generic plan read every key's row whenever the
statistics said a run has many tags: 2 ms a finish with the 15,000 keys the
benchmark's section (a) leaves. Same answers, same locks; the other functions of
the file are unchanged.

Reversing runs 0022's file again.
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0027_lifecycle.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0022_lifecycle.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0026_admit_fewer_queries")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
