"""``path("durable/schema/", include("durable.api.schema_urls"))``: the OpenAPI schema of
durable's HTTP API (needs the ``openapi`` extra, drf-spectacular)."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.urls import URLPattern, path

try:
    from durable.api.openapi import DurableSchemaView
except ImportError as exc:  # the optional dependency
    raise ImproperlyConfigured(
        'durable\'s OpenAPI schema needs drf-spectacular: pip install "django-durable-workflows[openapi]".'
    ) from exc

app_name = "durable-schema"

urlpatterns: list[URLPattern] = [path("", DurableSchemaView.as_view(), name="schema")]
