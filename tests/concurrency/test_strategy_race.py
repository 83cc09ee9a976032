"""The strategies stay exact under real parallelism: OS processes with their own connections.

How in-flight runs are measured: a deferred constraint trigger on ``durable_runtag``
runs when each transaction that changed a watched tag commits. It first locks one
row shared by every watched tag, then counts that tag's rows by status and records
the high-water marks. The lock makes those commits happen one at a time, and a
count taken after the lock is granted sees every earlier commit. So each count is
the exact state that commit leaves behind. This holds whoever commits: a starter,
a promoter handing a slot to a queued run (its own transaction), a completer, or
a CANCEL_IN_PROGRESS start that inserts its run and cancels a victim in one
transaction (its midway N+1 is never committed, so it is not counted). Two starts
that got past the quota together both commit, and the second count sees both.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction

from durable import DEFAULT_CONCURRENCY_STATUSES, Concurrency, Engine, RunStatus, Strategy
from durable.models import RunTag, WorkflowRun
from durable.testing import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
STARTERS = 8
COMPLETERS = 2
IN_FLIGHT = tuple(DEFAULT_CONCURRENCY_STATUSES)

_GAUGE_SQL = """
CREATE TABLE strat_gauge_lock (id int PRIMARY KEY);
INSERT INTO strat_gauge_lock VALUES (1);
CREATE TABLE strat_gauge (
    tag text PRIMARY KEY,
    cur int NOT NULL DEFAULT 0,         -- in flight after the last commit
    hwm int NOT NULL DEFAULT 0,         -- most runs in flight after any commit
    live_hwm int NOT NULL DEFAULT 0,    -- most runs not cancelled after any commit
    queued_hwm int NOT NULL DEFAULT 0   -- longest queue after any commit
);
CREATE TABLE strat_promotion (seq bigserial PRIMARY KEY, tag text NOT NULL, tag_id bigint NOT NULL, grp text NOT NULL);
CREATE FUNCTION strat_gauge_tick() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    t text := CASE WHEN TG_OP = 'DELETE' THEN OLD.tag ELSE NEW.tag END;
    n_flight int;
    n_queued int;
    n_live int;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM strat_gauge WHERE tag = t) THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM strat_gauge_lock WHERE id = 1 FOR UPDATE;
    SELECT count(*) FILTER (WHERE status IN (IN_FLIGHT)),
           count(*) FILTER (WHERE status = 'queued'),
           count(*) FILTER (WHERE status <> 'cancelled')
      INTO n_flight, n_queued, n_live
      FROM durable_runtag WHERE tag = t;
    UPDATE strat_gauge
       SET cur = n_flight, hwm = GREATEST(hwm, n_flight), live_hwm = GREATEST(live_hwm, n_live),
           queued_hwm = GREATEST(queued_hwm, n_queued)
     WHERE tag = t;
    IF TG_OP = 'UPDATE' AND OLD.status = 'queued' AND NEW.status = 'pending' THEN
        INSERT INTO strat_promotion (tag, tag_id, grp) VALUES (t, NEW.id, NEW.group_key);
    END IF;
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER strat_gauge_tick
    AFTER INSERT OR UPDATE OF status OR DELETE ON durable_runtag
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION strat_gauge_tick();
""".replace("IN_FLIGHT", ", ".join(f"'{status}'" for status in IN_FLIGHT))

_DROP_SQL = """
DROP TRIGGER IF EXISTS strat_gauge_tick ON durable_runtag;
DROP FUNCTION IF EXISTS strat_gauge_tick();
DROP TABLE IF EXISTS strat_promotion, strat_gauge, strat_gauge_lock;
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
        cursor.executemany("INSERT INTO strat_gauge (tag) VALUES (%s)", [[f"concurrency:{k}"] for k in keys])


def gauges() -> dict[str, dict[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tag, cur, hwm, live_hwm, queued_hwm FROM strat_gauge")
        return {
            tag.removeprefix("concurrency:"): dict(cur=cur, hwm=hwm, live_hwm=live, queued_hwm=queued)
            for tag, cur, hwm, live, queued in cursor.fetchall()
        }


def promotions() -> dict[tuple[str, str], list[int]]:
    """Tag row ids of the runs handed a slot, per (key, group), in commit order."""
    order: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    with connection.cursor() as cursor:
        cursor.execute("SELECT tag, grp, tag_id FROM strat_promotion ORDER BY seq")
        for tag, group, tag_id in cursor.fetchall():
            order[(tag.removeprefix("concurrency:"), group)].append(tag_id)
    return order


def race(
    tmp_path: Path,
    *,
    starts_each: int,
    keys: list[str],
    limit: int,
    strategy: Strategy,
    completers: int = 0,
    complete_keys: list[str] | None = None,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """Run STARTERS starter processes (and ``completers``), released together by the
    ``go`` file; return what they did, summed. Every process must exit 0."""
    db_name = settings.DATABASES["default"]["NAME"]
    common = ["--db", db_name, "--dir", str(tmp_path), "--limit", str(limit), "--strategy", strategy.value, *extra]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(name: str, *args: str) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:  # the child keeps its own copy of the handle
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.concurrency.strategy_worker", *args, "--name", name, *common],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def finished(name: str) -> None:
        code = procs[name].wait(timeout=60)
        assert code == 0, f"{name} exited {code}:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"

    for i in range(STARTERS):
        spawn(f"s{i}", "start", "--keys", ",".join(keys), "--n", str(starts_each), "--seed", str(i))
    for i in range(completers):
        spawn(f"c{i}", "complete", "--keys", ",".join(complete_keys or keys), "--seed", str(100 + i), "--cancel-every", "4")
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == len(procs), timeout=60, what="processes ready")
        (tmp_path / "go").touch()
        for i in range(STARTERS):
            finished(f"s{i}")
        (tmp_path / "stop").touch()
        for i in range(completers):
            finished(f"c{i}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    totals: dict[str, Any] = {
        "starts": 0,
        "created": collections.Counter(),
        "errors": collections.Counter(),
        "executed": 0,
        "cancelled": 0,
    }
    for path in tmp_path.glob("result-*.json"):
        for name, value in json.loads(path.read_text()).items():
            totals[name] += collections.Counter(value) if isinstance(value, dict) else value
    assert totals["starts"] == STARTERS * starts_each
    return totals


def in_flight(key: str) -> int:
    return RunTag.objects.filter(tag=f"concurrency:{key}", status__in=IN_FLIGHT).count()


def stranded(limits: dict[str, int]) -> list[str]:
    """Queued runs none of whose keys is full: they wait for nothing."""
    tags = {f"concurrency:{k}": limit for k, limit in limits.items()}
    counts = collections.Counter(RunTag.objects.filter(tag__in=list(tags), status__in=IN_FLIGHT).values_list("tag", flat=True))
    full = {tag for tag, limit in tags.items() if counts[tag] >= limit}
    queued_tags: dict[str, set[str]] = collections.defaultdict(set)
    for run_id, tag in RunTag.objects.filter(tag__in=list(tags), status=RunStatus.QUEUED).values_list("run__run_id", "tag"):
        queued_tags[run_id].add(tag)
    return sorted(run_id for run_id, its in queued_tags.items() if not its & full)


def assert_fifo_within_groups(order: dict[tuple[str, str], list[int]]) -> None:
    """A group's queued runs are handed slots oldest first, races or not."""
    for (key, group), ids in order.items():
        assert ids == sorted(ids), f"{key} group {group!r} was served out of order: {ids}"


def assert_every_start_accounted_for(totals: dict[str, Any]) -> None:
    db = collections.Counter(WorkflowRun.objects.filter(workflow="test.noop").values_list("status", flat=True))
    assert sum(db.values()) == sum(totals["created"].values())
    assert sum(db.values()) + sum(totals["errors"].values()) == totals["starts"]
    assert set(db) <= {"pending", "running", "completed", "cancelled", "queued"}, db


def drain(limits: dict[str, int]) -> None:
    """Release the runs in flight one at a time, alternately cancelling and executing
    them, until none is left: after every release, no queued run may be stranded,
    and in the end every queued run was handed a slot (no sweep)."""
    engine = Engine(dispatch=lambda engine, run: None)
    tags = [f"concurrency:{k}" for k in limits]
    for i in range(10_000):
        pending = RunTag.objects.filter(tag__in=tags, status=RunStatus.PENDING).order_by("id")
        run_id = pending.values_list("run__run_id", flat=True).first()
        if run_id is None:
            break
        if i % 3 == 0:
            engine.cancel(run_id)
        else:
            engine.execute(run_id)
        assert not stranded(limits), f"after releasing {run_id}"
    assert not RunTag.objects.filter(tag__in=tags, status__in=[*IN_FLIGHT, RunStatus.QUEUED]).exists()


# -- GROUP_ROUND_ROBIN ----------------------------------------------------------------


@pytest.mark.parametrize("nkeys, max_queued", [(1, 10), (4, None)], ids=["one-new-key-max-queued", "four-keys-unbounded"])
def test_group_round_robin_hands_off_without_exceeding_or_stranding(
    tmp_path: Path, gauge: None, nkeys: int, max_queued: int | None
) -> None:
    limit = 5
    limits = {f"grr:{uuid.uuid4().hex[:8]}:{i}": limit for i in range(nkeys)}
    watch(*limits)
    extra = [] if max_queued is None else ["--max-queued", str(max_queued)]
    totals = race(
        tmp_path,
        starts_each=20,
        keys=list(limits),
        limit=limit,
        strategy=Strategy.GROUP_ROUND_ROBIN,
        completers=COMPLETERS,
        extra=extra,
    )
    observed = gauges()

    for key in limits:
        assert observed[key]["hwm"] <= limit, f"{key}: {observed[key]['hwm']} runs in flight, limit {limit}"
        assert observed[key]["cur"] == in_flight(key)
    assert max(g["hwm"] for g in observed.values()) == limit  # the keys were really saturated
    if max_queued is None:
        assert max(g["queued_hwm"] for g in observed.values()) > 0  # runs really queued
        assert not totals["errors"]  # and none was refused
    else:
        # The queue bound is exact too (checked under the same lock), and it was reached.
        assert [g["queued_hwm"] for g in observed.values()] == [max_queued]
        assert set(totals["errors"]) == {"ConcurrencyQueueFullError"}
    assert_every_start_accounted_for(totals)
    # Releases (completions and cancels, no sweep) handed slots to queued runs, oldest first.
    assert totals["executed"] > 0 and totals["cancelled"] > 0
    order = promotions()
    assert sum(len(ids) for ids in order.values()) > 0
    assert_fifo_within_groups(order)
    # Once everyone stopped, before any sweep: no queued run waits while its key has room.
    assert not stranded(limits)
    drain(limits)


# -- CANCEL_IN_PROGRESS -----------------------------------------------------------------


def test_cancel_in_progress_admits_every_start_and_keeps_the_newest(tmp_path: Path, gauge: None) -> None:
    limit, starts_each = 3, 20
    key = f"cip:{uuid.uuid4().hex[:8]}"
    watch(key)
    totals = race(tmp_path, starts_each=starts_each, keys=[key], limit=limit, strategy=Strategy.CANCEL_IN_PROGRESS)
    observed = gauges()[key]
    assert observed["hwm"] == limit, observed  # never more, and the key was full
    # Every start was admitted and started at once.
    assert not totals["errors"]
    assert totals["created"] == {"pending": STARTERS * starts_each}
    runs = list(WorkflowRun.objects.filter(tags__tag=f"concurrency:{key}").order_by("id"))
    assert len(runs) == STARTERS * starts_each
    survivors = [r for r in runs if r.status == RunStatus.PENDING]
    cancelled = [r for r in runs if r.status == RunStatus.CANCELLED]
    assert len(survivors) == limit and len(cancelled) == len(runs) - limit
    # The survivors are the newest runs: the last ones admitted (the key's lock
    # orders admissions, and ids are drawn under it), and the newest by created_at.
    assert survivors == runs[-limit:]
    newest_cancelled = max(cancelled, key=lambda r: r.created_at)
    oldest_survivor = min(survivors, key=lambda r: r.created_at)
    assert newest_cancelled.created_at < oldest_survivor.created_at, (newest_cancelled, oldest_survivor)
    assert all(r.error["type"] == "durable.cancelled" and "CANCEL_IN_PROGRESS" in r.error["message"] for r in cancelled)


def test_cancel_in_progress_age_is_the_order_of_starts_not_of_enclosing_transactions() -> None:
    """A start made inside a longer transaction (a view under ATOMIC_REQUESTS) is as
    new as the moment it is admitted: it is not the next victim, nor shown older."""
    engine = Engine(dispatch=lambda engine, run: None)
    quota = Concurrency(key=f"cip:{uuid.uuid4().hex[:8]}", limit=2, strategy=Strategy.CANCEL_IN_PROGRESS)
    first = engine.start("test.noop", {"n": "first"}, concurrency=quota)
    started: list[Any] = []

    def other_request() -> None:
        try:
            started.append(engine.start("test.noop", {"n": "other"}, concurrency=quota))
        finally:
            connection.close()

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")  # the caller's transaction is under way...
        thread = threading.Thread(target=other_request)
        thread.start()  # ...when another request starts a run and commits
        thread.join()
        late = engine.start("test.noop", {"n": "late"}, concurrency=quota)  # admitted after it
    newest = engine.start("test.noop", {"n": "newest"}, concurrency=quota)
    (other,) = started

    runs = [h.refresh() for h in (first, other, late, newest)]
    assert [h.status for h in runs] == ["cancelled", "cancelled", "pending", "pending"]
    created = [h.record.created_at for h in runs]
    assert created == sorted(created), created


# -- CANCEL_NEWEST ------------------------------------------------------------------------


def test_cancel_newest_never_exceeds_the_limit_and_shows_the_cancelled(tmp_path: Path, gauge: None) -> None:
    limit, starts_each = 4, 20
    key = f"newest:{uuid.uuid4().hex[:8]}"
    watch(key)
    totals = race(tmp_path, starts_each=starts_each, keys=[key], limit=limit, strategy=Strategy.CANCEL_NEWEST)
    observed = gauges()[key]
    assert observed["hwm"] == limit, observed
    # Nothing completes: every run not cancelled is in flight, so they never exceed the limit either.
    assert observed["live_hwm"] == limit, observed
    assert not totals["errors"]
    assert totals["created"] == {"pending": limit, "cancelled": STARTERS * starts_each - limit}
    runs = list(WorkflowRun.objects.filter(tags__tag=f"concurrency:{key}").order_by("id"))
    assert len(runs) == STARTERS * starts_each
    # The first runs admitted keep the slots; every later one was created cancelled.
    assert [r.status for r in runs] == [RunStatus.PENDING] * limit + [RunStatus.CANCELLED] * (len(runs) - limit)
    for run in runs[limit:]:
        assert run.error["type"] == "durable.cancel_newest" and run.finished_at is not None
    assert in_flight(key) == limit


# -- several keys ---------------------------------------------------------------------------


def test_tenant_and_global_keys_neither_deadlock_nor_exceed(tmp_path: Path, gauge: None) -> None:
    tenant_limit, global_limit = 2, 5
    run = uuid.uuid4().hex[:8]
    tenants = [f"tenant:{run}:{i}" for i in range(4)]
    shared = f"global:{run}"
    limits = {shared: global_limit, **{t: tenant_limit for t in tenants}}
    watch(*limits)
    # Every process exits 0 within race()'s timeouts: a deadlock would fail there
    # (PostgreSQL aborts one side with DeadlockDetected, and that process exits 1).
    totals = race(
        tmp_path,
        starts_each=20,
        keys=tenants,
        limit=tenant_limit,
        strategy=Strategy.GROUP_ROUND_ROBIN,
        completers=COMPLETERS,
        complete_keys=[shared],
        extra=["--global-key", shared, "--global-limit", str(global_limit)],
    )
    observed = gauges()
    assert observed[shared]["hwm"] == global_limit, observed[shared]
    assert max(observed[t]["hwm"] for t in tenants) == tenant_limit, observed
    assert not totals["errors"]
    assert_every_start_accounted_for(totals)
    order = promotions()
    assert any(key == shared for key, _ in order)  # the shared key handed slots across tenants
    assert_fifo_within_groups(order)
    # A queued run waits only while one of its keys is full.
    assert not stranded(limits)
    drain(limits)


def test_concurrent_finishes_hand_off_on_several_keys_without_exceeding_or_stranding(tmp_path: Path, gauge: None) -> None:
    """Many completers finish and cancel runs at once while starters queue more, on
    tenant keys that share a global key: every release hands its slots on (one
    durable_promote on PostgreSQL), concurrently with the others'. No key ever
    holds more than its limit, and no queued run is left waiting while its keys
    have room."""
    tenant_limit, global_limit = 2, 4
    run = uuid.uuid4().hex[:8]
    tenants = [f"hammer:{run}:{i}" for i in range(3)]
    shared = f"hammer-global:{run}"
    limits = {shared: global_limit, **{t: tenant_limit for t in tenants}}
    watch(*limits)
    totals = race(
        tmp_path,
        starts_each=25,
        keys=tenants,
        limit=tenant_limit,
        strategy=Strategy.GROUP_ROUND_ROBIN,
        completers=6,
        extra=["--global-key", shared, "--global-limit", str(global_limit), "--releases", "60"],
    )
    observed = gauges()
    assert observed[shared]["hwm"] == global_limit, observed[shared]
    for tenant in tenants:
        assert observed[tenant]["hwm"] <= tenant_limit, observed[tenant]
        assert observed[tenant]["cur"] == in_flight(tenant)
    assert not totals["errors"]
    assert_every_start_accounted_for(totals)
    assert totals["executed"] + totals["cancelled"] > 60  # the completers really raced
    order = promotions()
    assert sum(len(ids) for ids in order.values()) > 30
    assert_fifo_within_groups(order)
    assert not stranded(limits)
    drain(limits)
