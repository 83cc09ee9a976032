"""Who may use the HTTP API: the permission classes named by ``DURABLE["API_PERMISSION_CLASSES"]``."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from rest_framework.permissions import BasePermission

from durable.conf import settings


def permission_classes() -> list[Any]:
    """The configured permission classes (dotted paths, or the classes themselves).

    Read on every request, so ``override_settings(DURABLE=...)`` applies at once.
    """
    configured = settings.API_PERMISSION_CLASSES
    if isinstance(configured, str) or not isinstance(configured, (list, tuple)):
        raise ImproperlyConfigured(
            'DURABLE["API_PERMISSION_CLASSES"] must be a list of dotted paths such as '
            f'["rest_framework.permissions.IsAuthenticated"], got {configured!r}.'
        )
    return [_load(entry) for entry in configured]


def get_permissions() -> list[BasePermission]:
    """Instances of the configured permission classes, as ``APIView.get_permissions`` returns."""
    return [permission() for permission in permission_classes()]


def _load(entry: Any) -> Any:
    if not isinstance(entry, str):
        return entry
    try:
        return import_string(entry)
    except ImportError as exc:
        raise ImproperlyConfigured(f'DURABLE["API_PERMISSION_CLASSES"] names {entry!r}, which cannot be imported: {exc}') from exc
