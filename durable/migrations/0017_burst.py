"""Burstable quotas: ``Concurrency(burst=Burst(pool=..., up_to=...))``.

``ConcurrencyLock.burst`` records a key's burst as its last start declared it
(the admin and the quota API show it). Runs ``sql/migrations/0017_admit.sql``:
``durable_admit`` decides a key's guaranteed and borrowed runs and answers the
column ``burst`` (so it is dropped and created again), with its helpers
``durable_burst_refusal`` and ``durable_lock_pool``. Reversing drops the three
and runs 0012's file again (which drops and creates ``durable_admit``).

Workers of the previous release read ``durable_admit``'s row as seven columns:
deploy the code with this migration (as for 0012, which added two).
"""

from pathlib import Path

from django.db import migrations, models

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0017_admit.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0012_admit.sql").read_text())
        schema_editor.execute(
            "DROP FUNCTION IF EXISTS durable_burst_refusal(jsonb, integer, bigint, bigint, integer, bigint);"
            " DROP FUNCTION IF EXISTS durable_lock_pool(text, integer, jsonb, boolean);"
        )


class Migration(migrations.Migration):
    dependencies = [("durable", "0016_step_slots")]

    operations = [
        migrations.AddField(
            model_name="concurrencylock",
            name="burst",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.RunPython(create, restore, elidable=False),
    ]
