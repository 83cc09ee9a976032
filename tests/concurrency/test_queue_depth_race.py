"""CANCEL_QUEUED_EXCEPT_NEWEST / _OLDEST stay exact under real parallelism: OS
processes with their own connections (tests/concurrency/strategy_worker.py).

The gauge of test_strategy_race (a deferred constraint trigger on ``durable_runtag``,
serialised by one lock row) records, after every commit that changed a watched
tag, the runs in flight and the runs queued: ``hwm`` and ``queued_hwm`` are the
most either ever was in a committed state. A start that queues its run and
cancels the oldest queued one does both in one transaction, so its midway
``max_queued + 1`` is never committed and never counted; two starts that both
got past the bound would both commit, and the count after the second sees both.
"""

from __future__ import annotations

import collections
import uuid
from pathlib import Path

import pytest

from durable import RunStatus, Strategy
from durable.models import WorkflowRun
from tests.concurrency.test_strategy_race import (  # noqa: F401  (gauge is a fixture)
    COMPLETERS,
    STARTERS,
    assert_every_start_accounted_for,
    assert_fifo_within_groups,
    drain,
    gauge,
    gauges,
    in_flight,
    promotions,
    race,
    stranded,
    watch,
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("gauge")]


def runs_of(key: str) -> list[WorkflowRun]:
    return list(WorkflowRun.objects.filter(tags__tag=f"concurrency:{key}").order_by("id"))


@pytest.mark.parametrize("nkeys", [1, 3], ids=["one-key", "three-keys"])
def test_except_newest_keeps_at_most_max_queued_and_the_newest(tmp_path: Path, nkeys: int) -> None:
    limit, max_queued = 2, 2
    limits = {f"qdn:{uuid.uuid4().hex[:8]}:{i}": limit for i in range(nkeys)}
    watch(*limits)
    totals = race(
        tmp_path,
        starts_each=20,
        keys=list(limits),
        limit=limit,
        strategy=Strategy.CANCEL_QUEUED_EXCEPT_NEWEST,
        completers=COMPLETERS,
        extra=["--max-queued", str(max_queued)],
    )
    observed = gauges()
    for key in limits:
        assert observed[key]["hwm"] <= limit, observed[key]
        assert observed[key]["queued_hwm"] <= max_queued, observed[key]
        assert observed[key]["cur"] == in_flight(key)
    # The keys were really saturated and their queues really full.
    assert max(g["hwm"] for g in observed.values()) == limit
    assert max(g["queued_hwm"] for g in observed.values()) == max_queued
    # No start is refused or created cancelled: each one is admitted or queued.
    assert not totals["errors"]
    assert set(totals["created"]) <= {"pending", "queued"}
    assert_every_start_accounted_for(totals)
    replaced = 0
    for key in limits:
        runs = runs_of(key)
        by_id = {r.run_id: r for r in runs}
        for run in runs:
            if run.status == RunStatus.CANCELLED and run.error["type"] == "durable.cancel_queued_except_newest":
                replaced += 1
                newer = by_id[run.error["replaced_by"]]  # a run of the same key...
                assert newer.id > run.id, (run.run_id, newer.run_id)  # ...admitted after it
                assert run.error["key"] == key
        # What waits at the end is the newest: a run queued while others waited
        # can only leave the queue after them, so the last runs admitted are the queued ones.
        queued = [r for r in runs if r.status == RunStatus.QUEUED]
        assert queued == runs[len(runs) - len(queued) :], key
    assert replaced > 0
    assert totals["executed"] > 0 and totals["cancelled"] > 0
    order = promotions()
    assert sum(len(ids) for ids in order.values()) > 0
    assert_fifo_within_groups(order)
    assert not stranded(limits)
    drain(limits)


def test_except_oldest_keeps_at_most_max_queued_and_cancels_newcomers(tmp_path: Path) -> None:
    limit, max_queued = 2, 3
    key = f"qdo:{uuid.uuid4().hex[:8]}"
    limits = {key: limit}
    watch(key)
    totals = race(
        tmp_path,
        starts_each=20,
        keys=[key],
        limit=limit,
        strategy=Strategy.CANCEL_QUEUED_EXCEPT_OLDEST,
        completers=COMPLETERS,
        extra=["--max-queued", str(max_queued)],
    )
    observed = gauges()[key]
    assert observed["hwm"] == limit, observed
    assert observed["queued_hwm"] == max_queued, observed  # never more, and reached
    assert not totals["errors"]
    assert totals["created"]["cancelled"] > 0 and totals["created"]["queued"] > 0
    assert_every_start_accounted_for(totals)
    runs = runs_of(key)
    at_start = [r for r in runs if r.error and r.error["type"] == "durable.cancel_queued_except_oldest"]
    assert len(at_start) == totals["created"]["cancelled"]
    assert all(r.finished_at is not None and r.error["key"] == key for r in at_start)
    # A queued run only ever leaves the queue by a hand-off (completers cancel pending runs):
    # none was replaced.
    assert not [r for r in runs if r.error and "replaced_by" in r.error]
    order = promotions()
    assert sum(len(ids) for ids in order.values()) > 0
    assert_fifo_within_groups(order)
    assert not stranded(limits)
    drain(limits)


def test_except_newest_tenant_and_global_keys_neither_deadlock_nor_exceed(tmp_path: Path) -> None:
    tenant_limit, global_limit, max_queued = 1, 3, 1
    run = uuid.uuid4().hex[:8]
    tenants = [f"qdt:{run}:{i}" for i in range(3)]
    shared = f"qdg:{run}"
    limits = {shared: global_limit, **{t: tenant_limit for t in tenants}}
    watch(*limits)
    totals = race(
        tmp_path,
        starts_each=15,
        keys=tenants,
        limit=tenant_limit,
        strategy=Strategy.CANCEL_QUEUED_EXCEPT_NEWEST,
        completers=COMPLETERS,
        complete_keys=[shared],
        extra=["--max-queued", str(max_queued), "--global-key", shared, "--global-limit", str(global_limit)],
    )
    observed = gauges()
    for key, limit in limits.items():
        assert observed[key]["hwm"] <= limit, (key, observed[key])
        # The global key keeps its default depth (1): its own queue never holds more.
        assert observed[key]["queued_hwm"] <= max_queued, (key, observed[key])
    assert observed[shared]["hwm"] == global_limit
    assert not totals["errors"]
    assert_every_start_accounted_for(totals)
    replaced = collections.Counter(
        r.error["key"]
        for r in WorkflowRun.objects.filter(workflow="test.noop", status=RunStatus.CANCELLED)
        if r.error.get("type") == "durable.cancel_queued_except_newest"
    )
    assert replaced  # queued runs really were replaced
    assert_fifo_within_groups(promotions())
    assert not stranded(limits)
    drain(limits)
