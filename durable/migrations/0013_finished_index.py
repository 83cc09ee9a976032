"""An index for deleting finished runs (``manage.py durable purge`` and
``DURABLE["RETENTION"]``): the runs of one finished status, oldest finished
first, so each batch of a purge reads one index range whatever the size of the
table. Partial: in-flight runs have no entry, so a start writes nothing to it.

On a big table, the index build locks writes to ``durable_workflowrun`` while it
runs.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable", "0012_limits")]

    operations = [
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(("status__in", ["cancelled", "completed", "dead", "failed"])),
                fields=["status", "finished_at", "id"],
                name="durable_run_finished_idx",
            ),
        ),
    ]
