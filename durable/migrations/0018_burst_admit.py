"""Burstable quotas, corrected: runs ``sql/migrations/0018_admit.sql``.

``durable_admit``'s second call (``"lock_pool": true``) recorded on a pool's row
the ``count_statuses`` of whichever key it was locked beside (a plain quota's
narrower statuses), so ``durable_promote`` then counted the pool with them and
over-filled it; it now records those of the burst naming the pool. A start
admitted with a burst is answered the keys that borrowed (``burst.keys``), not
only the pools. With ``"in_transaction"`` (a start inside the caller's
transaction, which held a lock before it) a pool is never waited for, and
``durable_lock_pool`` creates a missing pool row itself (waiting at most 50 ms
for a concurrent creation of it). The functions' signatures and columns are
unchanged. Reversing runs 0017's file again (which drops and creates
``durable_admit`` and replaces its helpers).
"""

from pathlib import Path

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "migrations"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0018_admit.sql").read_text())


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute((SQL_DIR / "0017_admit.sql").read_text())


class Migration(migrations.Migration):
    dependencies = [("durable", "0017_burst")]

    operations = [migrations.RunPython(create, restore, elidable=False)]
