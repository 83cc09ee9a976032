"""A run's round-robin group (its other concurrency tags, joined) and a key's
round-robin cursor are text without a length limit: six or more long keys made
them longer than the 1024 characters the columns held."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("durable", "0006_admit_restart")]

    operations = [
        migrations.AlterField(
            model_name="runtag",
            name="group_key",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.AlterField(
            model_name="concurrencylock",
            name="rr_cursor",
            field=models.TextField(blank=True, default=""),
        ),
    ]
