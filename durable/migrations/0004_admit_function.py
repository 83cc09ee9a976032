"""The PostgreSQL function that admits a REJECT start in one round trip.

Other databases use the ORM path of ``DjangoStore`` and get nothing here. This
migration runs the function as released with it (``sql/migrations/0004_admit.sql``),
never today's copy: later versions are installed by later migrations.
"""

from pathlib import Path

from django.db import migrations

SQL = (Path(__file__).resolve().parent.parent / "sql" / "migrations" / "0004_admit.sql").read_text()


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SQL)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS durable_admit(jsonb, text, text, text, text, text, jsonb, text, text)")


class Migration(migrations.Migration):
    dependencies = [("durable", "0003_execution")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
