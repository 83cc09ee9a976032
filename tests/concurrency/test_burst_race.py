"""Burstable quotas stay exact under real parallelism: OS processes with their own connections.

Measured at commit time, as in ``test_strategy_race``: a deferred constraint trigger
on ``durable_runtag`` runs when each transaction that changed a watched tag commits,
locks one row shared by every watched tag (so those commits are counted one at a
time, each count seeing every earlier commit), and records for each tenant key its
runs in flight, its borrowed ones and its guaranteed ones (the difference), and for
the pool its runs in flight, keeping the high-water marks.

The pool's name sorts before the tenant keys, so a run that borrows takes the pool's
lock out of key order (NOWAIT, then again in key order when it is busy), while the
"direct" starts (the tenant key without a burst, plus the pool as a quota of their
own) lock the pool first: every process must exit 0, which a deadlock (PostgreSQL
aborts one of its transactions) would prevent.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from durable import DEFAULT_CONCURRENCY_STATUSES, Burst, Concurrency, ConcurrencyLimitError, Engine
from durable.models import RunTag
from durable.testing import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
STARTERS = 8
IN_FLIGHT = ", ".join(f"'{status}'" for status in DEFAULT_CONCURRENCY_STATUSES)

_GAUGE_SQL = """
CREATE TABLE burst_gauge_lock (id int PRIMARY KEY);
INSERT INTO burst_gauge_lock VALUES (1);
CREATE TABLE burst_gauge (
    key text PRIMARY KEY,
    hwm int NOT NULL DEFAULT 0,             -- most runs in flight after any commit
    borrowed_hwm int NOT NULL DEFAULT 0,    -- most borrowed runs in flight after any commit
    guaranteed_hwm int NOT NULL DEFAULT 0   -- most guaranteed runs in flight after any commit
);
CREATE FUNCTION burst_gauge_tick() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    t text := CASE WHEN TG_OP = 'DELETE' THEN OLD.tag ELSE NEW.tag END;
    k text := regexp_replace(t, '^(concurrency|borrowed):', '');
    n_total int;
    n_borrowed int;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM burst_gauge WHERE key = k) THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM burst_gauge_lock WHERE id = 1 FOR UPDATE;
    SELECT count(*) FILTER (WHERE tag = 'concurrency:' || k), count(*) FILTER (WHERE tag = 'borrowed:' || k)
      INTO n_total, n_borrowed
      FROM durable_runtag WHERE tag IN ('concurrency:' || k, 'borrowed:' || k) AND status IN (IN_FLIGHT);
    UPDATE burst_gauge
       SET hwm = GREATEST(hwm, n_total), borrowed_hwm = GREATEST(borrowed_hwm, n_borrowed),
           guaranteed_hwm = GREATEST(guaranteed_hwm, n_total - n_borrowed)
     WHERE key = k;
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER burst_gauge_tick
    AFTER INSERT OR UPDATE OF status OR DELETE ON durable_runtag
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION burst_gauge_tick();
""".replace("IN_FLIGHT", IN_FLIGHT)

_DROP_SQL = """
DROP TRIGGER IF EXISTS burst_gauge_tick ON durable_runtag;
DROP FUNCTION IF EXISTS burst_gauge_tick();
DROP TABLE IF EXISTS burst_gauge, burst_gauge_lock;
"""


@pytest.fixture
def gauge() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(_GAUGE_SQL)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(_DROP_SQL)


def watch(*keys: str) -> None:
    with connection.cursor() as cursor:
        cursor.executemany("INSERT INTO burst_gauge (key) VALUES (%s)", [[k] for k in keys])


def gauges() -> dict[str, dict[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, hwm, borrowed_hwm, guaranteed_hwm FROM burst_gauge")
        return {k: dict(hwm=h, borrowed=b, guaranteed=g) for k, h, b, g in cursor.fetchall()}


def in_flight(tag: str) -> int:
    return RunTag.objects.filter(tag=tag, status__in=DEFAULT_CONCURRENCY_STATUSES).count()


def race(
    tmp_path: Path,
    *,
    keys: list[str],
    pool: str,
    pool_limit: int,
    starts_each: int,
    completers: int = 0,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """STARTERS starter processes (and ``completers``), released together by the ``go``
    file; what they did, summed. Every process must exit 0."""
    db_name = settings.DATABASES["default"]["NAME"]
    common = ["--db", db_name, "--dir", str(tmp_path), "--keys", ",".join(keys), "--pool", pool]
    common += ["--pool-limit", str(pool_limit), "--limit", "3", "--up-to", "8"]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(name: str, *args: str) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.concurrency.burst_worker", *args, "--name", name, *common],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def finished(name: str) -> None:
        code = procs[name].wait(timeout=120)
        assert code == 0, f"{name} exited {code}:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"

    for i in range(STARTERS):
        # Half the starters start inside a transaction of their own (the NOWAIT retry then uses a savepoint).
        flags = [*extra, *(["--atomic"] if i % 2 else [])]
        spawn(f"s{i}", "start", "--n", str(starts_each), "--seed", str(i), *flags)
    for i in range(completers):
        spawn(f"c{i}", "complete", "--seed", str(100 + i))
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == len(procs), timeout=60, what="processes ready")
        (tmp_path / "go").touch()
        for i in range(STARTERS):
            finished(f"s{i}")
        if completers:
            # The completers have released something before they are told to stop, however
            # the two cores were shared out while the starters ran.
            tags = [f"concurrency:{k}" for k in keys]
            wait_for(lambda: RunTag.objects.filter(tag__in=tags, status="completed").exists(), timeout=60, what="a release")
        (tmp_path / "stop").touch()
        for i in range(completers):
            finished(f"c{i}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    totals: dict[str, Any] = {"starts": 0, "created": collections.Counter(), "refused": collections.Counter(), "executed": 0}
    for path in tmp_path.glob("result-*.json"):
        for name, value in json.loads(path.read_text()).items():
            totals[name] += collections.Counter(value) if isinstance(value, dict) else value
    assert totals["starts"] == STARTERS * starts_each
    return totals


@pytest.fixture
def names() -> tuple[list[str], str]:
    """Four tenant keys and a pool whose name sorts before them (its lock is taken out of key order)."""
    run = uuid.uuid4().hex[:8]
    return [f"tenant:{run}:{i}" for i in range(4)], f"burst-pool:{run}"


def test_without_releases_every_tenant_gets_its_guarantee_and_the_pool_fills_exactly(
    tmp_path: Path, gauge: None, names: tuple[list[str], str], settings: Any
) -> None:
    keys, pool = names
    watch(*keys, pool)
    totals = race(tmp_path, keys=keys, pool=pool, pool_limit=10, starts_each=15)
    observed = gauges()
    for key in keys:
        assert observed[key]["hwm"] <= 8, f"{key}: {observed[key]['hwm']} runs in flight, up_to 8"
        assert observed[key]["guaranteed"] <= 3, f"{key}: {observed[key]['guaranteed']} guaranteed, limit 3"
        # Its guarantee was never refused, whatever the pool held: 3 guaranteed runs in the end.
        assert in_flight(f"concurrency:{key}") - in_flight(f"borrowed:{key}") == 3
    assert observed[pool]["hwm"] == 10 == in_flight(f"concurrency:{pool}")  # filled, never beyond
    assert sum(totals["created"].values()) == 4 * 3 + 10  # 120 starts: every guarantee, then the pool, exactly
    assert totals["created"]["burst:borrowed"] > 0
    assert set(totals["refused"]) <= {"burst:pool", "burst:up_to", "burst:pool_busy", "direct:limit"}

    # A tenant that comes now, the pool being full, still gets its guarantee.
    settings.DURABLE = {**settings.DURABLE, "POOLS": {pool: 10}}
    engine = Engine(dispatch=lambda engine, run: None)
    late = [Concurrency(key=f"{keys[0]}:late", limit=3, burst=Burst(pool=pool, up_to=8))]
    for _ in range(3):
        engine.start("test.noop", {}, concurrency=late)
    with pytest.raises(ConcurrencyLimitError) as info:
        engine.start("test.noop", {}, concurrency=late)
    assert (info.value.source, info.value.pool_active) == ("pool", 10)


def test_with_direct_pool_starts_and_releases_no_deadlock_and_no_limit_exceeded(
    tmp_path: Path, gauge: None, names: tuple[list[str], str]
) -> None:
    keys, pool = names
    watch(*keys, pool)
    totals = race(tmp_path, keys=keys, pool=pool, pool_limit=6, starts_each=40, completers=2, extra=["--direct-every", "3"])
    observed = gauges()
    for key in keys:
        assert observed[key]["hwm"] <= 8, f"{key}: {observed[key]['hwm']} runs in flight, up_to 8"
        assert observed[key]["guaranteed"] <= 3, f"{key}: {observed[key]['guaranteed']} guaranteed, limit 3"
    assert observed[pool]["hwm"] == 6, observed[pool]  # saturated, never beyond
    assert totals["executed"] > 0
    # Borrowed runs finished and their slots were borrowed again: more borrowed runs
    # (and direct ones) were admitted than the pool holds.
    assert totals["created"]["burst:borrowed"] + totals["created"]["direct:own"] > 6
    assert totals["created"]["direct:own"] > 0
