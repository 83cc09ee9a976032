"""A partial index of the tags of runs holding a slot (``durable_tag_slot_idx``):
``(tag, status, namespace)`` for the runs in the default ``count_statuses``, so a
key's count reads its runs in flight and none of its finished runs
(``durable_counted_tags``, migration 0025, reads it).

On PostgreSQL it is built with ``CREATE INDEX CONCURRENTLY``: starts and hand-offs
go on writing tags while it builds, however big the table. That cannot run in a
transaction, so this migration is not atomic; if the build fails (a deadlock, a
cancel), PostgreSQL leaves an invalid index behind: drop it
(``DROP INDEX CONCURRENTLY durable_tag_slot_idx``) and migrate again. Other databases
build it as usual.
"""

from django.db import migrations, models


class AddIndexConcurrently(migrations.AddIndex):
    """``AddIndex``, concurrently on PostgreSQL (``django.contrib.postgres``'s
    operation of that name runs on PostgreSQL alone)."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, concurrently=True)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index, concurrently=True)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("durable", "0023_slot_functions")]

    operations = [
        AddIndexConcurrently(
            model_name="runtag",
            index=models.Index(
                condition=models.Q(("status__in", ["pending", "running", "suspended", "blocked"])),
                fields=["tag", "status", "namespace"],
                name="durable_tag_slot_idx",
            ),
        ),
    ]
