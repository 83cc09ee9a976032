"""A schedule whose workflow uses a queue-depth strategy: a window on a full queue is
skipped with the strategy named (EXCEPT_OLDEST), or replaces the window queued before
it (EXCEPT_NEWEST)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from durable import Concurrency, Strategy, engine, models, schedules
from durable.schedules import Outcome
from durable.status import RunStatus
from tests.integration.test_schedules import make

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)


@pytest.fixture
def workflows() -> Iterator[None]:
    def body(ctx: Any, input: Any) -> Any:
        return input

    key = lambda input: input["key"]  # noqa: E731
    engine.register("sched.qd.oldest", "1", body, Concurrency(key=key, limit=1, strategy=Strategy.CANCEL_QUEUED_EXCEPT_OLDEST))
    engine.register("sched.qd.newest", "1", body, Concurrency(key=key, limit=1, strategy=Strategy.CANCEL_QUEUED_EXCEPT_NEWEST))
    yield
    engine.registry.unregister("sched.qd.oldest")
    engine.registry.unregister("sched.qd.newest")


def _fire(schedule: models.Schedule, minutes: int) -> Any:
    firing = schedules.fire(schedule.pk, now=NOW + timedelta(minutes=minutes))
    assert firing is not None
    return firing


def test_except_oldest_skips_a_window_on_a_full_queue_naming_the_strategy(workflows: None) -> None:
    schedule = make("qd-oldest", workflow="sched.qd.oldest", input={"key": "qd:o"})
    assert _fire(schedule, 0).handle.status == RunStatus.PENDING
    assert _fire(schedule, 1).handle.status == RunStatus.QUEUED
    skipped = _fire(schedule, 2)
    assert skipped.outcome is Outcome.SKIPPED and skipped.handle.status == RunStatus.CANCELLED
    last_error = models.Schedule.objects.get(name="qd-oldest").last_error
    assert "created cancelled (CANCEL_QUEUED_EXCEPT_OLDEST)" in last_error
    assert "the queue of concurrency key qd:o was full" in last_error


def test_except_newest_queues_the_latest_window(workflows: None) -> None:
    schedule = make("qd-newest", workflow="sched.qd.newest", input={"key": "qd:n"})
    _fire(schedule, 0)
    second = _fire(schedule, 1)
    third = _fire(schedule, 2)
    assert third.started and third.handle.status == RunStatus.QUEUED
    assert second.handle.refresh().status == RunStatus.CANCELLED
    assert second.handle.error["replaced_by"] == third.handle.run_id
