"""The quota is exact under real parallelism: OS processes with their own connections."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from durable import DEFAULT_CONCURRENCY_STATUSES
from durable.models import ConcurrencyLock, RunTag
from durable.testing import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
STARTERS = 8
STARTS_EACH = 50
COMPLETERS = 2
LIMIT = 5


@pytest.fixture
def gauge() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE race_gauge (key text PRIMARY KEY, cur int NOT NULL, hwm int NOT NULL)")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE race_gauge")


def run_race(tmp_path: Path, keys: list[str]) -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.executemany("INSERT INTO race_gauge VALUES (%s, 0, 0)", [[k] for k in keys])
    db_name = settings.DATABASES["default"]["NAME"]
    common = ["--db", db_name, "--dir", str(tmp_path), "--keys", ",".join(keys), "--limit", str(LIMIT)]
    procs = []
    for i in range(STARTERS):
        args = ["start", "--name", f"s{i}", "--n", str(STARTS_EACH), "--seed", str(i)]
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.concurrency.race_worker", *args, *common], cwd=ROOT))
    completers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.concurrency.race_worker",
                "complete",
                "--name",
                f"c{i}",
                "--seed",
                str(100 + i),
                *common,
            ],
            cwd=ROOT,
        )
        for i in range(COMPLETERS)
    ]
    everyone = procs + completers
    wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == len(everyone), timeout=60, what="processes ready")
    (tmp_path / "go").touch()
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    (tmp_path / "stop").touch()
    for proc in completers:
        assert proc.wait(timeout=60) == 0
    totals = {"admitted": 0, "refused": 0, "completed": 0}
    for path in tmp_path.glob("result-*.json"):
        for name, value in json.loads(path.read_text()).items():
            totals[name] += value
    return totals


def gauges() -> dict[str, tuple[int, int]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, cur, hwm FROM race_gauge")
        return {key: (cur, hwm) for key, cur, hwm in cursor.fetchall()}


def in_flight(key: str) -> int:
    return RunTag.objects.filter(tag=f"concurrency:{key}", status__in=DEFAULT_CONCURRENCY_STATUSES).count()


@pytest.mark.parametrize("trial", range(3))
def test_one_brand_new_key_never_exceeds_its_limit(tmp_path: Path, gauge: None, trial: int) -> None:
    key = f"race:{uuid.uuid4().hex}"
    assert not ConcurrencyLock.objects.filter(key=key).exists()
    totals = run_race(tmp_path, [key])
    cur, hwm = gauges()[key]
    assert hwm <= LIMIT, f"{hwm} runs were in flight at once with a limit of {LIMIT}"
    assert hwm == LIMIT  # the key was really saturated: the race was real
    assert totals["admitted"] + totals["refused"] == STARTERS * STARTS_EACH
    assert totals["refused"] > 0 and totals["completed"] > 0
    assert totals["admitted"] - totals["completed"] == cur == in_flight(key) <= LIMIT
    assert ConcurrencyLock.objects.filter(key=key).count() == 1


@pytest.mark.parametrize("trial", range(2))
def test_many_keys_at_once_never_exceed_their_limits(tmp_path: Path, gauge: None, trial: int) -> None:
    keys = [f"race:{uuid.uuid4().hex[:8]}:{i}" for i in range(6)]
    totals = run_race(tmp_path, keys)
    observed = gauges()
    for key in keys:
        cur, hwm = observed[key]
        assert hwm <= LIMIT, f"{key}: {hwm} runs in flight at once with a limit of {LIMIT}"
        assert cur == in_flight(key) <= LIMIT
    assert max(hwm for _, hwm in observed.values()) == LIMIT
    assert totals["admitted"] + totals["refused"] == STARTERS * STARTS_EACH
    assert totals["admitted"] - totals["completed"] == sum(cur for cur, _ in observed.values())
