"""Indexes for the lists (the API's ``GET runs/``, the admin's run list): newest
first, unfiltered or by one status, workflow or namespace, each an index range
read in that order, so a page costs the same with a thousand runs or a million.

The composite workflow and namespace indexes replace the single-column ones
(an equality lookup on either uses the composite). On a big table, the index
builds lock writes to ``durable_workflowrun`` while they run.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable", "0008_lifecycle_functions")]

    operations = [
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(fields=["-created_at", "-id"], name="durable_run_created_idx"),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(fields=["status", "-created_at", "-id"], name="durable_run_status_idx"),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(fields=["workflow", "-created_at", "-id"], name="durable_run_workflow_idx"),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(fields=["namespace", "-created_at", "-id"], name="durable_run_namespace_idx"),
        ),
        migrations.AlterField(
            model_name="workflowrun",
            name="workflow",
            field=models.CharField(max_length=255),
        ),
        migrations.AlterField(
            model_name="workflowrun",
            name="namespace",
            field=models.CharField(default="default", max_length=100),
        ),
    ]
