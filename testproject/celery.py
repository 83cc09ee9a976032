"""The test project's Celery app.

Broker: ``CELERY_BROKER_URL`` (e.g. redis://127.0.0.1:6379/0); without it the
in-memory transport, which serves a worker in the same process (the embedded
default used by the demo).
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

app = Celery("testproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _schedule_sweep(sender: Celery, **kwargs: object) -> None:
    from durable.tasks import beat_schedule

    sender.conf.beat_schedule = {**beat_schedule(), **(sender.conf.beat_schedule or {})}
