"""A backend for Django's tasks framework: every ``@task`` enqueued through it is a
durable run with one journaled step, executed by the project's Celery workers.

``TASKS = {"default": {"BACKEND": "durable.contrib.tasks.DurableBackend"}}``. It uses
``django.tasks`` on Django 6.0 and later, and the django-tasks backport (the
``[tasks]`` extra) on Django 5.2. See the how-to page "Django's tasks framework".
"""

from __future__ import annotations

from durable.contrib.tasks.backend import WORKFLOW, DurableBackend, DurableTask, TaskExited

__all__ = ["WORKFLOW", "DurableBackend", "DurableTask", "TaskExited"]
