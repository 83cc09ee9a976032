"""What the admin pages share: JSON display, lists in messages, links to runs, and the
one format of times (to the second), ages and durations (``4m 12s``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe

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


def pretty_error(value: Any) -> SafeString | str:
    """An ``error`` as ``pretty_json``, its ``traceback`` (when it has one) set below
    as the text it is, one frame a line, rather than a JSON string full of ``\\n``."""
    if not (isinstance(value, dict) and isinstance(value.get("traceback"), str)):
        return pretty_json(value)
    rest = {name: item for name, item in value.items() if name != "traceback"}
    return format_html(
        '{}<pre class="durable-traceback" style="margin:0.5em 0 0; white-space:pre-wrap">{}</pre>',
        pretty_json(rest),
        value["traceback"],
    )


def json_column(field: str) -> Callable[[Any, Any], SafeString | str]:
    """An admin display method showing the JSON ``field`` of a row with ``pretty_json``
    (``output_json = json_column("output")`` in a ``ModelAdmin`` or an inline); the
    ``error`` field with ``pretty_error``."""
    render = pretty_error if field == "error" else pretty_json

    @admin.display(description=field)
    def show(model_admin: Any, obj: Any) -> SafeString | str:
        return render(getattr(obj, field))

    return show


def listing(items: Sequence[str]) -> str:
    """``a, b, c`` (at most ``MAX_LISTED`` of them, then ``and N more``)."""
    shown = ", ".join(items[:MAX_LISTED])
    rest = len(items) - MAX_LISTED
    return f"{shown} and {rest} more" if rest > 0 else shown


def runs_with_tag_url(tag: str) -> str:
    """The runs changelist filtered to the runs carrying ``tag``."""
    return reverse("admin:durable_workflowrun_changelist") + "?" + urlencode({TAG_PARAMETER: tag})


def duration(delta: timedelta | None) -> str:
    """``delta`` in its two largest units: ``"12s"``, ``"4m 12s"``, ``"2h 3m"``, ``"3d 4h"``.

    The one format of ages and durations on every admin page. A negative delta
    (clocks a little apart) is ``"0s"``; ``None`` is ``""``.
    """
    if delta is None:
        return ""
    seconds = max(0, int(delta.total_seconds()))
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, seconds = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (seconds, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in parts[:2] if n or unit == parts[0][1])


def age(since: datetime | None, now: datetime | None = None) -> str:
    """How long ago ``since`` was (``duration`` of now minus it); ``""`` for ``None``."""
    if since is None:
        return ""
    return duration((now or timezone.now()) - since)


def timestamp(value: datetime | None) -> str:
    """``2026-11-30 22:39:41 UTC``: a time to the second, in the current timezone."""
    if value is None:
        return ""
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    return local.strftime("%Y-%m-%d %H:%M:%S ") + (local.tzname() or "")


def ago(value: datetime | None, now: datetime | None = None) -> SafeString | str:
    """``4m 12s ago`` with the exact time (``timestamp``) as its tooltip; ``""`` for ``None``."""
    if value is None:
        return ""
    return format_html('<span title="{}">{} ago</span>', timestamp(value), age(value, now))


def usage_bar(active: int, limit: int | None, *, ceiling: int | None = None, full: bool | None = None) -> SafeString:
    """``active / limit`` with a bar filled to the ratio, marked full (red, "FULL") when
    ``active`` reaches ``limit``. Without a known limit: the count alone.

    A key with a burst: ``ceiling`` is its ``up_to`` (the bar is filled to it, and the
    count reads ``active / limit + borrowable``), and ``full`` says whether a start
    would find no slot (at its ceiling, or beyond its limit with its pool full)."""
    if limit is None:
        return format_html('<span class="durable-use">{} / ?</span>', active)
    scale = limit if ceiling is None else max(ceiling, limit)
    if full is None:
        full = active >= scale
    ratio = 1.0 if scale <= 0 else min(1.0, active / scale)
    level = "full" if full else ("high" if ratio >= 0.75 else "ok")
    count = format_html("{} / {}", active, limit) if scale == limit else format_html("{} / {} + {}", active, limit, scale - limit)
    return format_html(
        '<span class="durable-use durable-use-{}" title="{} of {} slots in use">'
        '<span class="durable-bar"><span style="width:{}%"></span></span>'
        '<span class="durable-use-count">{}</span>{}</span>',
        level,
        active,
        scale,
        round(ratio * 100),
        count,
        mark_safe(' <strong class="durable-full">FULL</strong>') if full else "",
    )


def truncated(text: str, length: int = 80) -> SafeString | str:
    """``text`` cut to ``length`` characters on one line, the whole of it as the tooltip."""
    if not text:
        return ""
    short = text if len(text) <= length else text[: length - 1].rstrip() + "…"
    return format_html('<span class="durable-truncated" title="{}">{}</span>', text, short)


def compact_timestamp(value: datetime | None) -> SafeString | str:
    """``timestamp`` on two short lines (date, then time to the second) for a narrow column,
    the whole of it as the tooltip."""
    if value is None:
        return ""
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    return format_html(
        '<span class="durable-time" title="{}">{}<br>{}</span>',
        timestamp(value),
        local.strftime("%Y-%m-%d"),
        local.strftime("%H:%M:%S"),
    )


def time_column(field: str, description: str | None = None, *, compact: bool = False) -> Callable[[Any, Any], SafeString | str]:
    """An admin display method showing the datetime ``field`` of a row to the second
    (``started = time_column("started_at")``); ``compact``: on two lines, for a list."""

    @admin.display(description=description or field.replace("_at", "").replace("_", " "), ordering=field)
    def show(model_admin: Any, obj: Any) -> SafeString | str:
        value = getattr(obj, field)
        if value is None:
            return ""
        if compact:
            return compact_timestamp(value)
        return format_html('<span class="durable-time">{}</span>', timestamp(value))

    return show
