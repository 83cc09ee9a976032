"""The test suite's own Celery setup never touches another project's queue."""

from __future__ import annotations

import inspect

from testproject.celery import app
from tests import conftest


def test_the_queue_the_tests_purge_is_the_test_projects_own() -> None:
    # The celery_worker fixture purges the app's default queue: durable-test, never "celery".
    assert app.conf.task_default_queue == "durable-test"
    source = inspect.getsource(conftest.celery_worker)
    assert "queue_purge(celery_app.conf.task_default_queue)" in source and "control.purge()" not in source
