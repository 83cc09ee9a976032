"""Limits an operator changes live, and a Retry-After estimated per key.

``ConcurrencyLock.limit_override`` replaces the code's limit at admission (read
under the key's lock) and ``LimitChange`` records every change of it;
``ConcurrencyLock.recent_durations`` keeps the durations of the key's last runs.
Runs ``sql/migrations/0012_admit.sql`` and ``0012_queue.sql`` (``durable_admit``
and ``durable_admit_queued`` read the override and answer the estimate,
``durable_promote`` reads the override) and ``0012_lifecycle.sql``
(``durable_finish`` records the durations); reversing drops the first two and
runs 0011's, 0010's and 0008's files again.
"""

from pathlib import Path

import django.db.models.deletion
import django.db.models.functions.datetime
from django.conf import settings
from django.db import migrations, models

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in ("0012_admit.sql", "0012_queue.sql", "0012_lifecycle.sql"):
            schema_editor.execute((SQL_DIR / name).read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "DROP FUNCTION IF EXISTS durable_admit(jsonb, text, text, text, text, text, jsonb, text, text, boolean);"
            " DROP FUNCTION IF EXISTS durable_admit_queued(jsonb, text, text, text, text, text, jsonb, text, text, boolean, jsonb);"
        )
        for name in ("0011_admit_refusal.sql", "0010_queue.sql", "0008_lifecycle.sql"):
            schema_editor.execute((SQL_DIR / name).read_text())


class Migration(migrations.Migration):

    dependencies = [
        ('durable', '0011_admit_refusal'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='concurrencylock',
            name='limit_override',
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='concurrencylock',
            name='recent_durations',
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='concurrencylock',
            name='durations_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name='LimitChange',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('key', models.CharField(db_index=True, max_length=255)),
                ('old_override', models.IntegerField(blank=True, null=True)),
                ('new_override', models.IntegerField(blank=True, null=True)),
                ('old_limit', models.IntegerField(blank=True, null=True)),
                ('new_limit', models.IntegerField(blank=True, null=True)),
                ('reason', models.TextField()),
                ('changed_by_name', models.CharField(blank=True, default='', max_length=255)),
                ('changed_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('changed_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'verbose_name': 'limit change',
                'ordering': ['-changed_at', '-id'],
            },
        ),
        migrations.RunPython(create, restore, elidable=False),
    ]
