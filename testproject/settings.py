"""Settings of the test project.

Embedded default: SQLite and an in-process Celery worker (memory transport), no
services needed. Set ``DATABASE_URL`` (postgres://...) and ``CELERY_BROKER_URL``
(redis://...) to run on PostgreSQL and Redis.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import dj_database_url
import django

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "insecure-testproject-key-do-not-use-in-production")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "rest_framework",
    "rest_framework.authtoken",
    "durable",
    "testproject.chat",
]
#: Django's tasks framework: built in from Django 6.0, the django-tasks backport on 5.2 (the [tasks] extra).
HAS_TASKS = django.VERSION >= (6, 0) or importlib.util.find_spec("django_tasks") is not None
if HAS_TASKS and django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "testproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
WSGI_APPLICATION = "testproject.wsgi.application"

_sqlite = {
    "ENGINE": "django.db.backends.sqlite3",
    "NAME": os.environ.get("SQLITE_PATH", str(BASE_DIR / "db.sqlite3")),
    # IMMEDIATE: every transaction takes SQLite's write lock at BEGIN, so the
    # quota's count-then-insert is serialised exactly as on PostgreSQL.
    "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
    "TEST": {"NAME": os.environ.get("SQLITE_TEST_PATH", str(BASE_DIR / "test-db.sqlite3"))},
}
_default: dict[str, Any] = dict(dj_database_url.config(conn_max_age=0)) if os.environ.get("DATABASE_URL") else _sqlite
DATABASES = {"default": _default}
if os.environ.get("DATABASE_SERVER_SIDE_BINDING") and _default["ENGINE"].endswith("postgresql"):
    # Django's server-side parameter binding, with psycopg's prepared statements (a
    # statement sent 5 times is prepared): what a project without a transaction pooler may turn on.
    _default["OPTIONS"] = {**_default.get("OPTIONS", {}), "server_side_binding": True, "prepare_threshold": 5}
if os.environ.get("DURABLE_TEST_DB"):
    # Lets several test runs share one PostgreSQL server without sharing a database.
    DATABASES["default"]["TEST"] = {"NAME": os.environ["DURABLE_TEST_DB"]}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

REST_FRAMEWORK = {
    "EXCEPTION_HANDLER": "durable.api.exception_handler",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "memory://")
# A queue of the test project's own: the tests purge it, never another project's "celery" queue.
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "durable-test")
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

DURABLE: dict[str, object] = {
    key: float(os.environ[f"DURABLE_{key}"])
    for key in ("HEARTBEAT_INTERVAL", "STALE_AFTER", "REDISPATCH_AFTER", "SWEEP_INTERVAL", "PUBLISH_BATCH_INTERVAL")
    if os.environ.get(f"DURABLE_{key}")
}
if os.environ.get("DURABLE_TASK_QUEUE"):
    DURABLE["TASK_QUEUE"] = os.environ["DURABLE_TASK_QUEUE"]
if os.environ.get("DURABLE_MAX_ATTEMPTS"):
    DURABLE["MAX_ATTEMPTS"] = int(os.environ["DURABLE_MAX_ATTEMPTS"])
if os.environ.get("DURABLE_KEEP_WORKER_CONNECTION"):  # "0" for Django's connection (a comparison of the bench)
    DURABLE["KEEP_WORKER_CONNECTION"] = os.environ["DURABLE_KEEP_WORKER_CONNECTION"] != "0"

if HAS_TASKS:
    # Tasks enqueued with @task(...).enqueue() are durable runs (see the how-to "Django's tasks framework").
    TASKS = {
        "default": {
            "BACKEND": "durable.contrib.tasks.DurableBackend",
            "QUEUES": ["default", "emails"],
        }
    }

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"durable": {"handlers": ["console"], "level": os.environ.get("DURABLE_LOG_LEVEL", "WARNING")}},
}
