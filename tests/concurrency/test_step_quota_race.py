"""Step-level quotas stay exact under real parallelism: OS processes executing runs,
each with its own connection, all asking for one step key.

How steps in their bodies are measured: the step body (``tests.workflows.gauged``)
bumps one gauge row when it enters and lowers it when it leaves, each UPDATE
committing on its own; the row lock orders them, so ``hwm`` is the most bodies
that were inside at once, observed in the database.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from durable import RunStatus, engine
from durable.models import StepSlot, WorkflowRun
from durable.testing import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 6
RUNS = 36
LIMIT = 3


@pytest.fixture
def gauge() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE step_gauge (cur int NOT NULL, hwm int NOT NULL, entries int NOT NULL, executions int NOT NULL)"
        )
        cursor.execute("INSERT INTO step_gauge VALUES (0, 0, 0, 0)")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS step_gauge")


def read_gauge() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT cur, hwm, entries, executions FROM step_gauge")
        cur, hwm, entries, executions = cursor.fetchone()
    return {"cur": cur, "hwm": hwm, "entries": entries, "executions": executions}


def race(tmp_path: Path, *, reject: bool) -> dict[str, int]:
    key = "provider:race"
    for i in range(RUNS):
        # Bodies that last longer than the work around them, so that they overlap.
        input = {"key": key, "limit": LIMIT, "pause": 0.2 + 0.02 * (i % 5), "reject": reject}
        engine.start("test.step_race", input, run_id=f"race-{i}")
    db_name = settings.DATABASES["default"]["NAME"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for i in range(WORKERS):
        name = f"w{i}"
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.concurrency.step_worker", "--db", db_name, "--dir", str(tmp_path)]
                + ["--name", name, "--seed", str(i)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    runs = WorkflowRun.objects.filter(workflow="test.step_race")
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == WORKERS, timeout=60, what="workers ready")
        (tmp_path / "go").touch()
        wait_for(lambda: not runs.exclude(status__in=[RunStatus.COMPLETED]).exists(), timeout=180, what="every run to complete")
        (tmp_path / "stop").touch()
        for name, proc in procs.items():
            code = proc.wait(timeout=60)
            assert code == 0, f"{name} exited {code}:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    executed = sum(json.loads(p.read_text())["executed"] for p in tmp_path.glob("result-*.json"))
    outputs = list(runs.values_list("output", flat=True))
    return {**read_gauge(), "executed": executed, "done": outputs.count("done"), "refused": outputs.count("refused")}


def test_waiting_steps_never_exceed_the_limit_and_all_run(tmp_path: Path, gauge: None) -> None:
    result = race(tmp_path, reject=False)
    # Every step ran its body once, never more than LIMIT at once (a broken lock
    # shows above it), and the key was full at times: runs parked for a slot, so
    # their workflow bodies executed twice (once to park, once after the hand-off).
    assert result["done"] == result["entries"] == RUNS
    assert result["hwm"] <= LIMIT
    assert result["executions"] > RUNS
    assert result["cur"] == 0
    assert not StepSlot.objects.exists()  # every slot given back, no waiter left


def test_rejecting_steps_never_exceed_the_limit(tmp_path: Path, gauge: None) -> None:
    result = race(tmp_path, reject=True)
    assert result["done"] + result["refused"] == RUNS
    assert result["entries"] == result["done"]  # a refused step never entered its body
    assert result["hwm"] <= LIMIT
    assert result["refused"] > 0  # the key was full at times: the limit was tested
    assert not StepSlot.objects.exists()
