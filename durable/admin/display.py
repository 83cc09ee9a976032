"""What the admin pages share: JSON display, lists in messages, links to runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString

#: How many run ids a message lists before it says "and N more".
MAX_LISTED = 10
#: The query parameter of the runs changelist's tag filter (``?tag=concurrency:acme``).
TAG_PARAMETER = "tag"


def pretty_json(value: Any) -> SafeString | str:
    """``value`` as indented JSON in a ``<pre>`` block (escaped); empty for ``None``."""
    if value is None:
        return ""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)
    return format_html('<pre style="margin:0; white-space:pre-wrap">{}</pre>', text)


def json_column(field: str) -> Callable[[Any, Any], SafeString | str]:
    """An admin display method showing the JSON ``field`` of a row with ``pretty_json``
    (``output_json = json_column("output")`` in a ``ModelAdmin`` or an inline)."""

    @admin.display(description=field)
    def show(model_admin: Any, obj: Any) -> SafeString | str:
        return pretty_json(getattr(obj, field))

    return show


def listing(items: Sequence[str]) -> str:
    """``a, b, c`` (at most ``MAX_LISTED`` of them, then ``and N more``)."""
    shown = ", ".join(items[:MAX_LISTED])
    rest = len(items) - MAX_LISTED
    return f"{shown} and {rest} more" if rest > 0 else shown


def runs_with_tag_url(tag: str) -> str:
    """The runs changelist filtered to the runs carrying ``tag``."""
    return reverse("admin:durable_workflowrun_changelist") + "?" + urlencode({TAG_PARAMETER: tag})
