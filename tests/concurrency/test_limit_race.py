"""A limit changed live under a storm of starters (PostgreSQL, threads with their own
connections): every admission applies the limit in effect when it counted."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from durable import Concurrency, ConcurrencyLimitError, Engine, RunStatus
from durable.runtime import Registry
from tests.threads import started

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

THREADS = 6
CODE_LIMIT = 8


def _engine() -> Engine:
    registry = Registry()
    registry.register("w", "1", lambda ctx, input: None)
    return Engine(dispatch=lambda engine, run: None, registry=registry)


def _storm(engine: Engine, key: str, *, until: threading.Event, log: list[tuple[float, float, bool]]) -> None:
    """Start runs of ``key`` until ``until`` is set, logging (began, ended, admitted) of each start."""
    while not until.is_set():
        began = time.monotonic()
        try:
            engine.start("w", {}, concurrency=Concurrency(key=key, limit=CODE_LIMIT))
            admitted = True
        except ConcurrencyLimitError:
            admitted = False
        log.append((began, time.monotonic(), admitted))


def _hammer(engine: Engine, key: str, seconds: float, during: Any = None) -> list[tuple[float, float, bool]]:
    """``THREADS`` starters for ``seconds``; ``during()`` runs in this thread meanwhile
    (its return value is returned with the log)."""
    stop = threading.Event()
    log: list[tuple[float, float, bool]] = []
    threads = [started(lambda: _storm(engine, key, until=stop, log=log)) for _ in range(THREADS)]
    try:
        result = during() if during is not None else None
        time.sleep(seconds)
    finally:
        stop.set()
        for thread in threads:
            thread.outcome()
    return log if during is None else (log, result)  # type: ignore[return-value]


def test_a_limit_lowered_mid_storm_applies_to_every_start_after_it_and_cancels_nothing() -> None:
    engine = _engine()
    key = f"override:{uuid.uuid4().hex}"
    tag = f"concurrency:{key}"

    # 1. Lowered from 8 to 2 while starters race to fill the key.
    def lower() -> float:
        time.sleep(0.05)  # the storm is under way
        engine.set_limit_override(key, 2, "incident")
        return time.monotonic()  # the change has committed

    log, committed = _hammer(engine, key, 0.5, during=lower)
    active = engine.count_runs(tag=tag)
    assert 2 <= active <= CODE_LIMIT, active
    after = [admitted for began, _, admitted in log if began > committed]
    assert after and not any(after), f"{sum(after)} of {len(after)} starts begun after the change were admitted"
    # Nothing was cancelled: every run admitted is still in flight.
    assert engine.count_runs(tag=tag, statuses=[RunStatus.PENDING]) == active == sum(a for _, _, a in log)

    # 2. Raised to 5 with every slot freed: the storm admits exactly 5.
    for handle in engine.list_runs(tag=tag):
        engine.cancel(handle.run_id)
    engine.set_limit_override(key, 5, "recovered")
    _hammer(engine, key, 0.5)
    assert engine.count_runs(tag=tag, statuses=[RunStatus.PENDING]) == 5

    # 3. Lowered to 3 below the 5 in flight: they stay, every start is refused.
    engine.set_limit_override(key, 3, "shrink")
    log = _hammer(engine, key, 0.3)
    assert log and not any(a for _, _, a in log)
    assert engine.count_runs(tag=tag, statuses=[RunStatus.PENDING]) == 5

    # 4. Cleared: the code's limit (8) again, exactly.
    engine.set_limit_override(key, None, "normal")
    _hammer(engine, key, 0.5)
    assert engine.count_runs(tag=tag, statuses=[RunStatus.PENDING]) == CODE_LIMIT


def test_a_limit_raised_mid_storm_is_never_exceeded() -> None:
    engine = _engine()
    key = f"override:{uuid.uuid4().hex}"
    engine.set_limit_override(key, 1, "start small")

    def raise_() -> None:
        time.sleep(0.1)
        engine.set_limit_override(key, 4, "grow")

    _hammer(engine, key, 0.5, during=raise_)
    assert engine.count_runs(tag=f"concurrency:{key}", statuses=[RunStatus.PENDING]) == 4
