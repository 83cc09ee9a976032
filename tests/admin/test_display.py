"""The one format of ages and durations, and times to the second."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils.html import escape

from durable.admin import display


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(seconds=12), "12s"),
        (timedelta(minutes=4, seconds=12), "4m 12s"),
        (timedelta(hours=2, minutes=3, seconds=59), "2h 3m"),
        (timedelta(days=3, hours=4, minutes=30), "3d 4h"),
        (timedelta(hours=2), "2h"),
        (timedelta(days=1, minutes=5), "1d"),
        (timedelta(seconds=-3), "0s"),  # clocks a little apart
    ],
)
def test_duration(delta: timedelta, text: str) -> None:
    assert display.duration(delta) == text


def test_age_and_timestamp_to_the_second() -> None:
    at = datetime(2026, 11, 30, 22, 39, 41, 690000, tzinfo=UTC)
    assert display.timestamp(at) == "2026-11-30 22:39:41 UTC"
    assert display.age(at, now=at + timedelta(minutes=4, seconds=12)) == "4m 12s"
    assert display.age(None) == ""
    assert 'title="2026-11-30 22:39:41 UTC">4m 12s ago' in display.ago(at, now=at + timedelta(minutes=4, seconds=12))


def test_usage_bar_marks_a_full_key() -> None:
    full = display.usage_bar(8, 8)
    assert "8 / 8" in full and "FULL" in full and "durable-use-full" in full and "width:100%" in full
    half = display.usage_bar(2, 4)
    assert "2 / 4" in half and "FULL" not in half and "width:50%" in half
    assert "FULL" in display.usage_bar(0, 0)  # a limit of 0 refuses every start
    assert "3 / ?" in display.usage_bar(3, None)


def test_truncated_keeps_the_whole_text_in_the_tooltip() -> None:
    text = "Concurrency limit reached for key 'tenant:stark' " * 3
    shown = display.truncated(text, 40)
    assert f'title="{escape(text)}"' in shown
    assert f">{escape(text[:39])}…<" in shown
    assert display.truncated("short").endswith(">short</span>")
