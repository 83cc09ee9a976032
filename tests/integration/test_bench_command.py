"""Smoke tests of ``manage.py durable_bench``: it runs and reports; no timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]
_OVER_ROW = re.compile(r"^b\s+over-admission after refusal storm\s+(?P<count>\d+)\s")


@pytest.mark.postgres
def test_smallest_run_prints_targets_and_over_admission_and_drops_its_database() -> None:
    scratch = f"durable_bench_smoke_{os.getpid()}"
    command = [
        sys.executable, "manage.py", "durable_bench", "--quick", "--only", "b",
        "--starters", "2", "--hot-limit", "3", "--hot-seconds", "0.3", "--db-name", scratch,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "targets" in lines
    rows = [m for m in map(_OVER_ROW.match, lines) if m]
    assert len(rows) == 1
    assert rows[0]["count"] == "0"  # quota exactness, not speed: no run beyond the limit
    verdicts = [line.split()[0] for line in lines[lines.index("targets") + 1 :]]
    assert verdicts and set(verdicts) <= {"PASS", "MISS", "N/A"}
    assert len(verdicts) == 3  # refusal p99, over-admission after the storm, during churn
    db = settings.DATABASES["default"]
    params = {"host": db.get("HOST"), "port": db.get("PORT"), "user": db.get("USER"), "password": db.get("PASSWORD")}
    conninfo = make_conninfo("", dbname="postgres", **{k: str(v) for k, v in params.items() if v})
    with psycopg.connect(conninfo) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (scratch + "%",)).fetchall()
    assert left == []


def test_refuses_sqlite() -> None:
    if connection.vendor == "postgresql":
        pytest.skip("checks the refusal on SQLite")
    with pytest.raises(CommandError, match="PostgreSQL only"):
        call_command("durable_bench", "--quick")
