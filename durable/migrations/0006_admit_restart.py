"""``durable_admit`` checks a given run id before refusing (an idempotent re-start
racing the first start is never refused), and records ``WorkflowRun.fenced``.

Runs ``sql/migrations/0006_admit_restart.sql``; reversing drops it and runs
0004's file again.
"""

from pathlib import Path

from django.db import migrations, models

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"
OLD_SIGNATURE = "durable_admit(jsonb, text, text, text, text, text, jsonb, text, text)"
NEW_SIGNATURE = "durable_admit(jsonb, text, text, text, text, text, jsonb, text, text, boolean)"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {OLD_SIGNATURE}")
        schema_editor.execute((SQL_DIR / "0006_admit_restart.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {NEW_SIGNATURE}")
        schema_editor.execute((SQL_DIR / "0004_admit.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0005_redispatches")]

    operations = [
        migrations.AddField(
            model_name="workflowrun",
            name="fenced",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.RunPython(create, restore, elidable=False),
    ]
