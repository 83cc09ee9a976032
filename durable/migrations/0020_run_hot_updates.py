"""Drop ``durable_run_active_idx`` (``status, heartbeat_at`` of the active runs).

It named ``heartbeat_at``, so every heartbeat and every journal write (each beats
the run's heartbeat) changed an indexed column: PostgreSQL could never update the
run's row in place (a HOT update) and added an entry to each of the run table's
indexes instead. Without it those updates change no indexed column. The sweeper's
queries (the running runs whose heartbeat is old, the pending runs whose message
is) read ``durable_run_status_idx``, as they already did.

Reversing creates the index again.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("durable", "0019_lifecycle_take")]

    operations = [migrations.RemoveIndex(model_name="workflowrun", name="durable_run_active_idx")]
