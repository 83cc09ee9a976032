"""Tenant fencing: which engine serves an API request.

With ``DURABLE["API_NAMESPACE"]`` set to the dotted path of ``fn(request) -> str``,
every request gets ``durable.engine.in_namespace(fn(request), scope_reads=True)``: its runs
are created in that namespace, and it reads, lists, cancels and counts quotas of
that namespace only. ``fn`` may return ``None`` for a user that belongs to no
namespace: the request is then refused (403). Without the setting, the default
engine ``durable.engine`` serves every request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request

import durable
from durable import models
from durable.conf import settings
from durable.runtime.engine import Engine


def request_engine(request: Request) -> Engine:
    """The engine of this request (call it after authentication): the default
    engine, or, with ``API_NAMESPACE``, the default engine in the request's
    namespace with reads fenced to it."""
    base = durable.engine
    resolver = _resolver()
    if resolver is None:
        return base
    namespace = resolver(request)
    if namespace is None:
        raise PermissionDenied("This account is not assigned to a durable namespace.")
    max_length = models.WorkflowRun._meta.get_field("namespace").max_length or 100
    if not isinstance(namespace, str) or not namespace or len(namespace) > max_length or "\x00" in namespace:
        raise ImproperlyConfigured(
            f'The function of DURABLE["API_NAMESPACE"] must return a namespace string of 1 to '
            f"{max_length} characters (or None to refuse the request), got {namespace!r}."
        )
    return base.in_namespace(namespace, scope_reads=True)


def _resolver() -> Callable[[Request], Any] | None:
    configured = settings.API_NAMESPACE
    if not configured:
        return None
    if callable(configured):
        return configured
    try:
        resolver = import_string(configured)
    except ImportError as exc:
        raise ImproperlyConfigured(f'DURABLE["API_NAMESPACE"] names {configured!r}, which cannot be imported: {exc}') from exc
    if not callable(resolver):
        raise ImproperlyConfigured(f'DURABLE["API_NAMESPACE"] must name a function fn(request) -> str, got {resolver!r}.')
    return resolver
