"""Limits changed live (``Engine.set_limit_override``), the Retry-After estimate and
dry-run admission (``Engine.would_admit``), on DjangoStore and InMemoryStore."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import TestCase

from durable import (
    Concurrency,
    ConcurrencyLimitError,
    ConcurrencyQueueFullError,
    DjangoStore,
    Engine,
    InMemoryStore,
    RunStatus,
    Strategy,
)
from durable import conf as durable_conf
from durable.exceptions import InvalidStartError, RunIdTaken
from durable.runtime import Registry
from durable.stores import RunRecord
from durable.stores.base import RECENT_DURATIONS, add_duration, estimate

pytestmark = pytest.mark.django_db


def _noop(ctx: Any, input: Any) -> Any:
    return None


class Sent:
    def __init__(self) -> None:
        self.runs: list[str] = []

    def __call__(self, engine: Engine, run: RunRecord) -> None:
        self.runs.append(run.run_id)


@pytest.fixture(params=["django", "memory"])
def engine(request: pytest.FixtureRequest) -> Engine:
    store = DjangoStore() if request.param == "django" else InMemoryStore()
    return Engine(store, dispatch=Sent(), registry=Registry())


def key_of(input: dict[str, Any]) -> str:
    return f"tenant:{input['tenant']}"


def register(engine: Engine, limit: int = 2, **options: Any) -> None:
    engine.register("chat.turn", "1", _noop, concurrency=Concurrency(key=key_of, limit=limit, **options))


def start(engine: Engine, tenant: str = "acme", **kwargs: Any) -> Any:
    return engine.start("chat.turn", {"tenant": tenant}, **kwargs)


def finish(engine: Engine, run_id: str) -> None:
    assert engine.store.transition(run_id, from_statuses=list(RunStatus.values), to=RunStatus.COMPLETED)


def changes(engine: Engine) -> list[Any]:
    if isinstance(engine.store, InMemoryStore):
        return list(reversed(engine.store.limit_changes))
    from durable.models import LimitChange

    return list(LimitChange.objects.all())


# -- overrides -------------------------------------------------------------------------


def test_an_override_replaces_the_code_limit_on_the_next_start_and_clearing_restores_it(engine: Engine) -> None:
    register(engine, limit=2)
    start(engine)
    engine.set_limit_override("tenant:acme", 1, "incident 42")
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine)
    assert (info.value.limit, info.value.active) == (1, 1)
    engine.set_limit_override("tenant:acme", None, "incident over")
    start(engine)  # the code's limit (2) again
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine)
    assert info.value.limit == 2


def test_an_override_may_raise_the_limit_above_the_codes(engine: Engine) -> None:
    register(engine, limit=1)
    start(engine)
    engine.set_limit_override("tenant:acme", 3, "big customer")
    start(engine)
    start(engine)
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine)
    assert (info.value.limit, info.value.active) == (3, 3)
    assert engine.count_runs(tag="concurrency:tenant:acme") == 3


def test_an_override_set_before_any_start_of_its_key_applies_to_the_first(engine: Engine) -> None:
    register(engine, limit=5)
    change = engine.set_limit_override("tenant:new", 0, "blocked")
    assert (change.old_limit, change.new_limit, change.old_override, change.new_override) == (None, 0, None, 0)
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine, "new")
    assert info.value.limit == 0
    assert engine.count_runs() == 0
    start(engine, "other")  # other keys keep the code's limit


def test_lowering_below_the_active_count_cancels_nothing_and_refuses_new_starts(engine: Engine) -> None:
    register(engine, limit=4)
    runs = [start(engine) for _ in range(3)]
    engine.set_limit_override("tenant:acme", 1, "shrink")
    assert all(r.refresh().status == RunStatus.PENDING for r in runs)
    for run in runs[:2]:
        finish(engine, run.run_id)
    with pytest.raises(ConcurrencyLimitError):
        start(engine)  # 1 in flight, limit 1
    finish(engine, runs[2].run_id)
    start(engine)


def test_every_change_is_recorded_with_who_when_old_new_and_why(engine: Engine, django_user_model: Any) -> None:
    register(engine, limit=2)
    start(engine)
    user = django_user_model.objects.create_user("ops", password="x")
    engine.set_limit_override("tenant:acme", 5, "  launch day  ", user=user)
    engine.set_limit_override("tenant:acme", None, "back to normal")
    latest, first = changes(engine)[:2]
    assert (first.key, first.old_limit, first.new_limit, first.old_override, first.new_override) == (
        "tenant:acme",
        2,
        5,
        None,
        5,
    )
    assert (first.reason, first.changed_by_name) == ("launch day", "ops")
    assert first.changed_at is not None
    assert (latest.old_limit, latest.new_limit, latest.new_override, latest.changed_by_name) == (5, 2, None, "")
    if not isinstance(engine.store, InMemoryStore):
        assert first.changed_by == user and latest.changed_by is None


@pytest.mark.parametrize(
    ("key", "limit", "reason"),
    [
        ("", 1, "r"),
        ("k" * 201, 1, "r"),
        ("a\x00b", 1, "r"),
        (7, 1, "r"),
        ("k", True, "r"),
        ("k", 1.5, "r"),
        ("k", "3", "r"),
        ("k", 2**31, "r"),
        ("k", 1, ""),
        ("k", 1, "   "),
        ("k", 1, None),
        ("k", 1, "x" * 2001),
    ],
)
def test_a_bad_change_is_refused_and_changes_nothing(engine: Engine, key: Any, limit: Any, reason: Any) -> None:
    with pytest.raises(InvalidStartError):
        engine.set_limit_override(key, limit, reason)
    assert changes(engine) == []
    assert engine.store.limit_overrides(["k"]) == {}


def test_raising_the_limit_of_a_queued_key_hands_the_new_room_to_its_queued_runs(engine: Engine) -> None:
    register(engine, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)
    start(engine)
    queued = [start(engine) for _ in range(3)]
    assert {q.refresh().status for q in queued} == {RunStatus.QUEUED}
    with TestCase.captureOnCommitCallbacks(execute=True):
        engine.set_limit_override("tenant:acme", 3, "catch up")
    assert [q.refresh().status for q in queued] == [RunStatus.PENDING, RunStatus.PENDING, RunStatus.QUEUED]


def test_a_lowered_limit_queues_starts_of_a_round_robin_key_and_promotes_by_it(engine: Engine) -> None:
    register(engine, limit=3, strategy=Strategy.GROUP_ROUND_ROBIN)
    first, second = start(engine), start(engine)
    engine.set_limit_override("tenant:acme", 1, "shrink")
    third = start(engine)
    assert third.refresh().status == RunStatus.QUEUED
    finish(engine, first.run_id)
    engine.promoter.promote(["tenant:acme"])
    assert third.refresh().status == RunStatus.QUEUED  # second is still in flight: 1 of 1
    finish(engine, second.run_id)
    engine.promoter.promote(["tenant:acme"])
    assert third.refresh().status == RunStatus.PENDING


def test_cancel_in_progress_makes_room_under_the_override(engine: Engine) -> None:
    register(engine, limit=5, strategy=Strategy.CANCEL_IN_PROGRESS)
    runs = [start(engine) for _ in range(3)]
    engine.set_limit_override("tenant:acme", 2, "shrink")
    start(engine)
    # Room for the new one under 2: the two oldest are cancelled.
    assert [r.refresh().status for r in runs] == [RunStatus.CANCELLED, RunStatus.CANCELLED, RunStatus.PENDING]


def test_a_per_start_concurrency_is_overridden_too(engine: Engine) -> None:
    register(engine)
    engine.set_limit_override("plan:free", 1, "abuse")
    engine.start("chat.turn", {"tenant": "x"}, concurrency=Concurrency(key="plan:free", limit=10))
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("chat.turn", {"tenant": "y"}, concurrency=Concurrency(key="plan:free", limit=10))
    assert info.value.limit == 1


# -- Retry-After -------------------------------------------------------------------------


def test_retry_after_seconds_clamps_the_estimate_and_falls_back_to_the_setting(settings: Any) -> None:
    settings.DURABLE = {"RETRY_AFTER": 7, "RETRY_AFTER_MAX": 30}
    assert durable_conf.retry_after_seconds(None) == 7
    assert durable_conf.retry_after_seconds(float("nan")) == 7
    assert durable_conf.retry_after_seconds(-5.0) == 1
    assert durable_conf.retry_after_seconds(0.2) == 1
    assert durable_conf.retry_after_seconds(12.1) == 13
    assert durable_conf.retry_after_seconds(999.0) == 30
    settings.DURABLE = {"RETRY_AFTER": "bad", "RETRY_AFTER_MAX": None}
    assert durable_conf.retry_after_seconds(None) == 1
    assert durable_conf.retry_after_seconds(50.0) == 1


def test_the_estimate_is_the_median_minus_the_oldest_age() -> None:
    durations: list[float] = []
    for seconds in range(1, RECENT_DURATIONS + 5):
        durations = add_duration(durations, float(seconds))
    assert len(durations) == RECENT_DURATIONS and durations[0] == 5.0  # the oldest ones dropped
    assert estimate([10.0, 30.0, 20.0], 4.0) == 16.0
    assert estimate([], 4.0) is None
    assert estimate([10.0], None) == 10.0


def test_a_refusal_without_measured_runs_says_retry_after_the_setting(engine: Engine, settings: Any) -> None:
    settings.DURABLE = {"RETRY_AFTER": 9}
    register(engine, limit=1)
    start(engine)
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine)
    assert info.value.retry_after == 9


def _claim_and_finish(engine: Engine, run_id: str) -> None:
    store = engine.store
    assert store.claim(run_id, lease="l", worker="w", stale_before=store_now() - timedelta(seconds=60)) is not None
    assert store.finish(run_id, "l", status=RunStatus.COMPLETED, output=None)


def store_now() -> Any:
    from django.utils import timezone

    return timezone.now()


def _age_runs(engine: Engine, seconds: float) -> None:
    """Make every run and tag ``seconds`` older (the store's clock cannot be moved)."""
    if isinstance(engine.store, InMemoryStore):
        for run in engine.store._runs.values():
            assert run.created_at is not None
            run.created_at -= timedelta(seconds=seconds)
        return
    from django.db.models import F

    from durable.models import RunTag, WorkflowRun

    WorkflowRun.objects.update(created_at=F("created_at") - timedelta(seconds=seconds))
    RunTag.objects.update(created_at=F("created_at") - timedelta(seconds=seconds))


def test_a_refusal_estimates_retry_after_from_the_keys_finished_runs(engine: Engine, settings: Any) -> None:
    settings.DURABLE = {"RETRY_AFTER": 1, "RETRY_AFTER_MAX": 600}
    register(engine, limit=1)
    done = start(engine)
    _age_runs(engine, 100)  # it held its slot 100 s
    _claim_and_finish(engine, done.run_id)
    start(engine)
    _age_runs(engine, 30)  # the one in flight is 30 s old
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine)
    # The median of the key's durations (100 s) minus the age of the one in flight (30 s), rounded up.
    assert 70 <= info.value.retry_after <= 72, info.value.retry_after
    settings.DURABLE = {"RETRY_AFTER_MAX": 20}
    with pytest.raises(ConcurrencyLimitError) as info:
        start(engine)
    assert info.value.retry_after == 20


def test_a_finish_records_a_duration_at_most_once_a_second_per_key(engine: Engine) -> None:
    register(engine, limit=5)
    runs = [start(engine) for _ in range(3)]
    for run in runs:
        _claim_and_finish(engine, run.run_id)
    assert len(_durations(engine, "tenant:acme")) == 1  # the first; the others came within the second


def _durations(engine: Engine, key: str) -> list[float]:
    if isinstance(engine.store, InMemoryStore):
        return engine.store._durations.get(key, [])
    from durable.models import ConcurrencyLock

    return ConcurrencyLock.objects.get(key=key).recent_durations or []


def test_a_full_queue_estimates_retry_after_too(engine: Engine, settings: Any) -> None:
    settings.DURABLE = {"RETRY_AFTER": 3}
    register(engine, limit=1, strategy=Strategy.GROUP_ROUND_ROBIN, max_queued=1)
    start(engine)
    start(engine)
    with pytest.raises(ConcurrencyQueueFullError) as info:
        start(engine)
    assert info.value.retry_after == 3


# -- dry run -------------------------------------------------------------------------------


def _nothing_written(engine: Engine) -> None:
    assert engine.count_runs() == 0
    if isinstance(engine.store, DjangoStore):
        from durable.models import ConcurrencyLock

        assert not ConcurrencyLock.objects.exists()


def test_would_admit_answers_and_creates_nothing(engine: Engine) -> None:
    register(engine, limit=2)
    check = engine.would_admit("chat.turn", {"tenant": "acme"})
    assert check.admitted and bool(check)
    assert (check.outcome, check.key, check.limit, check.active) == ("admit", "tenant:acme", 2, 0)
    assert [k.as_dict() for k in check.keys] == [
        {
            "key": "tenant:acme",
            "limit": 2,
            "code_limit": 2,
            "override": None,
            "active": 0,
            "queued": 0,
            "strategy": "reject",
            "max_queued": None,
        }
    ]
    _nothing_written(engine)


def test_would_admit_says_reject_with_the_errors_figures(engine: Engine, settings: Any) -> None:
    settings.DURABLE = {"RETRY_AFTER": 4}
    register(engine, limit=1)
    start(engine)
    check = engine.would_admit("chat.turn", {"tenant": "acme"})
    assert not check.admitted
    assert (check.outcome, check.limit, check.active, check.retry_after) == ("reject", 1, 1, 4)
    assert "Concurrency limit reached" in check.detail
    assert check.as_dict()["retry_after"] == 4
    assert engine.count_runs() == 1


def test_would_admit_applies_the_override(engine: Engine) -> None:
    register(engine, limit=1)
    start(engine)
    engine.set_limit_override("tenant:acme", 2, "more")
    check = engine.would_admit("chat.turn", {"tenant": "acme"})
    assert check.admitted and (check.limit, check.keys[0].code_limit, check.keys[0].override) == (2, 1, 2)


@pytest.mark.parametrize(
    ("options", "outcome", "admitted"),
    [
        ({"strategy": Strategy.GROUP_ROUND_ROBIN}, "queue", False),
        ({"strategy": Strategy.GROUP_ROUND_ROBIN, "max_queued": 0}, "queue_full", False),
        ({"strategy": Strategy.CANCEL_NEWEST}, "cancel_newest", False),
        ({"strategy": Strategy.CANCEL_IN_PROGRESS}, "cancel_in_progress", True),
    ],
)
def test_would_admit_gives_each_strategys_outcome(engine: Engine, options: Any, outcome: str, admitted: bool) -> None:
    register(engine, limit=1, **options)
    first = start(engine)
    check = engine.would_admit("chat.turn", {"tenant": "acme"})
    assert (check.outcome, check.admitted, check.key, check.active) == (outcome, admitted, "tenant:acme", 1)
    assert engine.count_runs() == 1 and first.refresh().status == RunStatus.PENDING  # nothing cancelled


def test_would_admit_an_existing_run_id_says_exists(engine: Engine) -> None:
    register(engine, limit=1)
    start(engine, run_id="r1")
    check = engine.would_admit("chat.turn", {"tenant": "acme"}, run_id="r1")
    assert (check.outcome, check.admitted) == ("exists", False)
    engine.register("other", "1", _noop)
    with pytest.raises(RunIdTaken):
        engine.would_admit("other", {}, run_id="r1")
    with pytest.raises(InvalidStartError):
        engine.would_admit("chat.turn", {"tenant": "acme"}, run_id="a/b")


def test_would_admit_without_quotas_admits(engine: Engine) -> None:
    engine.register("free", "1", _noop)
    check = engine.would_admit("free", {"x": 1})
    assert (check.admitted, check.outcome, check.key, check.keys) == (True, "admit", None, [])
