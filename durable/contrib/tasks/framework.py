"""The tasks framework this process has: ``django.tasks`` (Django 6.0 and later),
else the ``django-tasks`` backport (``django_tasks``, for Django 5.2).

Everything the backend needs from the framework is imported here, under one set
of names, so the rest of ``durable.contrib.tasks`` never asks which one it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:  # django-stubs describe django.tasks; the backport has the same names
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import DEFAULT_TASK_PRIORITY, Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    NAME = "django.tasks"
else:
    try:  # Django 6.0+
        from django.tasks import DEFAULT_TASK_QUEUE_NAME, task_backends
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.base import DEFAULT_TASK_PRIORITY, Task, TaskContext, TaskError, TaskResult, TaskResultStatus
        from django.tasks.exceptions import InvalidTask as InvalidTaskError
        from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
        from django.tasks.signals import task_enqueued, task_finished, task_started
        from django.utils.json import normalize_json

        NAME = "django.tasks"
    except ImportError:
        try:  # the backport, on Django 5.2
            from django_tasks import DEFAULT_TASK_QUEUE_NAME, task_backends
            from django_tasks.backends.base import BaseTaskBackend
            from django_tasks.base import DEFAULT_TASK_PRIORITY, Task, TaskContext, TaskError, TaskResult, TaskResultStatus
            from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist, TaskResultMismatch
            from django_tasks.signals import task_enqueued, task_finished, task_started
            from django_tasks.utils import normalize_json

            NAME = "django_tasks"
        except ImportError as exc:
            raise ImproperlyConfigured(
                "durable.contrib.tasks needs Django's tasks framework: Django 6.0 or later (django.tasks), or on "
                "Django 5.2 the django-tasks backport. Install it with the extra: pip install "
                "'django-durable-workflows[tasks]'."
            ) from exc

__all__ = [
    "DEFAULT_TASK_PRIORITY",
    "DEFAULT_TASK_QUEUE_NAME",
    "NAME",
    "BaseTaskBackend",
    "InvalidTaskError",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "normalize_json",
    "set_field",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]


def set_field(obj: Any, name: str, value: Any) -> None:
    """Set a field of one of the framework's frozen dataclasses (``TaskResult``), as
    the framework's own backends do."""
    object.__setattr__(obj, name, value)
