"""The index of ``WorkflowRun.parent`` holds the children only (``parent_id IS NOT NULL``).

Django indexes every ``ForeignKey``, and a btree keeps NULLs: each top-level run (most
runs) had an entry in it, written at its start and again at each change of its status
(a claim, a suspension, a finish: updates that are not HOT). Every query that reads
the index asks for the children of given runs (``parent_id = ...``: a run's active
children, retention's unfinished children, the runs a purge sets free), which the
partial index answers.

On PostgreSQL both steps run ``CONCURRENTLY`` (the migration is not atomic), so a
busy run table is not locked against starts meanwhile. A concurrent build that fails
leaves an invalid ``durable_run_parent_idx``, which ``IF NOT EXISTS`` would keep: drop
it before running the migration again. Reversing puts the full index back under its
old name.
"""

from django.db import migrations, models

FULL_INDEX = "durable_workflowrun_parent_id_cbb16613"
PARTIAL_INDEX = "durable_run_parent_idx"


def _concurrently(schema_editor) -> str:
    return " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""


def to_partial(apps, schema_editor):
    how = _concurrently(schema_editor)
    schema_editor.execute(
        f"CREATE INDEX{how} IF NOT EXISTS {PARTIAL_INDEX} ON durable_workflowrun (parent_id) WHERE parent_id IS NOT NULL"
    )
    schema_editor.execute(f"DROP INDEX{how} IF EXISTS {FULL_INDEX}")


def to_full(apps, schema_editor):
    how = _concurrently(schema_editor)
    schema_editor.execute(f"CREATE INDEX{how} IF NOT EXISTS {FULL_INDEX} ON durable_workflowrun (parent_id)")
    schema_editor.execute(f"DROP INDEX{how} IF EXISTS {PARTIAL_INDEX}")


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("durable", "0030_run_id_without_like_index")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    "workflowrun",
                    "parent",
                    models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=models.deletion.SET_NULL,
                        related_name="children",
                        to="durable.workflowrun",
                    ),
                ),
                migrations.AddIndex(
                    "workflowrun",
                    models.Index(
                        fields=["parent"], name=PARTIAL_INDEX, condition=models.Q(parent__isnull=False)
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(to_partial, to_full, elidable=False)],
        )
    ]
