"""Starts of one key computing different CEL limits race while runs finish
(PostgreSQL, threads with connections of their own): each start is admitted under
its own limit, counted against every run of the key in flight.

How the runs in flight are measured: an admitted start bumps a gauge row in the
same transaction as its insert, while it still holds the key's lock; a finish
lowers the gauge in the same transaction as the finish. The gauge row's lock
orders these transactions, so the value a start's bump returns is the exact
number of the key's runs in flight when it commits. Admission counted at most
``limit - 1`` runs under the key's lock, and only finishes can commit between its
count and its bump, so that value is at most the start's own limit, and a start
admitted past its limit (under another start's limit, say) shows above it.
"""

from __future__ import annotations

import random
import threading
import uuid
from typing import Any

import pytest
from django.db import connection, transaction

from durable import Concurrency, ConcurrencyLimitError, Engine, RunStatus
from durable.models import RunTag
from durable.runtime import Registry
from tests.threads import started

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

LIMITS = {"premium": 4, "free": 2}
STARTERS = {"premium": 2, "free": 2}
#: Rounds of starts; each begins on an empty key, its starters released together.
ROUNDS = 20
ATTEMPTS = 4


@pytest.fixture
def gauge() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE cel_limit_gauge (key text PRIMARY KEY, cur int NOT NULL)")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE cel_limit_gauge")


def _engine() -> Engine:
    registry = Registry()
    limit = f"input.tier == 'premium' ? {LIMITS['premium']} : {LIMITS['free']}"
    registry.register("w", "1", lambda ctx, input: None, Concurrency(expression="input.key", limit=limit))
    return Engine(dispatch=lambda engine, run: None, registry=registry)


def _bump(key: str, by: int) -> int:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE cel_limit_gauge SET cur = cur + %s WHERE key = %s RETURNING cur", [by, key])
        return int(cursor.fetchone()[0])


def _starter(engine: Engine, key: str, tier: str, rounds: threading.Barrier) -> list[tuple[str, int]]:
    """``ATTEMPTS`` starts in each of ``ROUNDS`` rounds; for each start: ("admitted",
    runs in flight at its commit) or ("refused", the limit its error carries)."""
    log = []
    try:
        for _ in range(ROUNDS):
            rounds.wait(timeout=60)
            for _ in range(ATTEMPTS):
                try:
                    with transaction.atomic():
                        engine.start("w", {"key": key, "tier": tier})
                        log.append(("admitted", _bump(key, 1)))
                except ConcurrencyLimitError as exc:
                    log.append(("refused", exc.limit))
            rounds.wait(timeout=60)
    except BaseException:
        rounds.abort()
        raise
    return log


def _finish(engine: Engine, key: str, run_ids: list[str]) -> int:
    """Finish ``run_ids`` (those still pending) in one transaction that lowers the gauge as much."""
    with transaction.atomic():
        done = sum(engine.store.transition(r, from_statuses=[RunStatus.PENDING], to=RunStatus.COMPLETED) for r in run_ids)
        if done:
            _bump(key, -done)
    return done


def _pending(key: str) -> list[str]:
    tags = RunTag.objects.filter(tag=f"concurrency:{key}", status=RunStatus.PENDING)
    return list(tags.values_list("run__run_id", flat=True))


def _completer(engine: Engine, key: str, until: threading.Event) -> int:
    """Finish one run of ``key`` in flight at a time until ``until`` is set."""
    rng = random.Random(7)
    finished = 0
    while not until.is_set():
        pending = _pending(key)
        if pending:
            finished += _finish(engine, key, [rng.choice(pending)])
    return finished


def test_racing_starts_with_different_computed_limits_each_stay_within_their_own(gauge: Any) -> None:
    engine = _engine()
    key = f"cel:{uuid.uuid4().hex}"
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO cel_limit_gauge VALUES (%s, 0)", [key])
    stop = threading.Event()
    rounds = threading.Barrier(sum(STARTERS.values()) + 1)
    completer = started(lambda: _completer(engine, key, stop))
    starters = {
        (tier, n): started(lambda tier=tier: _starter(engine, key, tier, rounds))
        for tier, count in STARTERS.items()
        for n in range(count)
    }
    try:
        for _ in range(ROUNDS):
            _finish(engine, key, _pending(key))  # an empty key
            rounds.wait(timeout=60)  # the starters go
            rounds.wait(timeout=60)  # they are done
    except threading.BrokenBarrierError:
        pass  # a starter failed: its outcome() below raises why
    finally:
        stop.set()
        logs = {name: thread.outcome() for name, thread in starters.items()}
        finished = completer.outcome()

    by_tier: dict[str, list[tuple[str, int]]] = {tier: [] for tier in LIMITS}
    for (tier, _), log in logs.items():
        by_tier[tier].extend(log)
    for tier, log in by_tier.items():
        in_flight = [value for outcome, value in log if outcome == "admitted"]
        refused = [value for outcome, value in log if outcome == "refused"]
        # Every admission within its own limit; every refusal under its own limit.
        assert max(in_flight) <= LIMITS[tier], (tier, max(in_flight))
        assert set(refused) == {LIMITS[tier]}, (tier, set(refused))
    # The race mixed the limits for real: premium starts went past the free limit,
    # free starts were admitted and refused, and runs finished meanwhile.
    assert max(v for o, v in by_tier["premium"] if o == "admitted") > LIMITS["free"]
    assert {o for o, _ in by_tier["free"]} == {"admitted", "refused"}
    assert finished > 0
    # The gauge agrees with the store: it measured what was in flight.
    with connection.cursor() as cursor:
        cursor.execute("SELECT cur FROM cel_limit_gauge WHERE key = %s", [key])
        assert cursor.fetchone()[0] == engine.count_runs(tag=f"concurrency:{key}", statuses=[RunStatus.PENDING])
