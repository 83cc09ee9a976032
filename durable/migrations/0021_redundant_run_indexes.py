"""Drop the index Django gave each ``run`` foreign key of the tag, journal, signal and
step slot tables: each table's unique constraint (or, for signals,
``durable_signal_pending_idx``) starts with ``run_id`` and serves the same lookups,
so the extra index only cost every insert (a start's tags, each journal entry) and
every status change mirrored on the tags.

Only the indexes are dropped (``DROP INDEX``, on PostgreSQL and SQLite alike): the
``AlterField`` Django would run drops and re-adds each foreign key, which validates
every row of a big table while holding a lock on it. Reversing creates the indexes
again.
"""

from django.db import migrations, models

#: (model, the foreign key's related_name, table, Django's name of its run_id index)
INDEXES = [
    ("runtag", "tags", "durable_runtag", "durable_runtag_run_id_ec2a92f9"),
    ("signal", "signals", "durable_signal", "durable_signal_run_id_11abb04c"),
    ("steprecord", "steps", "durable_steprecord", "durable_steprecord_run_id_70f40bc7"),
    ("stepslot", "step_slots", "durable_stepslot", "durable_stepslot_run_id_42d9a971"),
]


class Migration(migrations.Migration):
    dependencies = [("durable", "0020_run_hot_updates")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{index}"', f'CREATE INDEX IF NOT EXISTS "{index}" ON "{table}" ("run_id")'
                )
                for _, _, table, index in INDEXES
            ],
            state_operations=[
                migrations.AlterField(
                    model_name=model,
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.CASCADE,
                        related_name=related_name,
                        to="durable.workflowrun",
                    ),
                )
                for model, related_name, _, _ in INDEXES
            ],
        )
    ]
