"""The test suite's own Celery setup never touches another project's queue."""

from __future__ import annotations

from testproject.celery import app


def test_the_queue_the_tests_purge_is_the_test_projects_own() -> None:
    # The celery_worker fixture calls control.purge(), which empties every queue
    # the app declares: that must be durable-test only, never the default "celery".
    app.loader.import_default_modules()
    assert sorted(app.amqp.queues) == ["durable-test"]
    assert app.conf.task_default_queue == "durable-test"
