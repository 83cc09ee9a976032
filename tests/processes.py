"""Real Celery worker subprocesses for the tests that kill, restart or add workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from testproject.celery import app as celery_app

ROOT = Path(__file__).resolve().parents[1]

#: Fast recovery in the worker processes (the tests' own process gets the same from conftest).
FAST = {"DURABLE_HEARTBEAT_INTERVAL": "0.2", "DURABLE_STALE_AFTER": "2", "DURABLE_SWEEP_INTERVAL": "0.5"}


class WorkerProcesses:
    """Workers on a Celery queue of the test's own (no other worker takes its runs),
    sharing the test database and broker. Each logs to ``<tmp_path>/<name>.log``."""

    def __init__(self, settings: Any, tmp_path: Path) -> None:
        broker = celery_app.conf.broker_url
        if not broker.startswith("redis://"):
            pytest.skip("needs a Redis broker shared with worker processes: set CELERY_BROKER_URL")
        db = settings.DATABASES["default"]
        if db["ENGINE"] != "django.db.backends.postgresql":
            pytest.skip("needs PostgreSQL shared with worker processes: set DATABASE_URL")
        self.queue = f"durable-test-{uuid.uuid4().hex[:8]}"
        settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": self.queue}
        self.tmp_path = tmp_path
        self.env = {
            **os.environ,
            **FAST,
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "CELERY_BROKER_URL": broker,
            "DURABLE_TASK_QUEUE": self.queue,
            "PYTHONPATH": str(ROOT),
        }
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        name: str,
        *,
        queues: str | None = None,
        include: str = "tests.workflows",
        beat: bool = False,
        pool: str = "solo",
        concurrency: int = 1,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "testproject",
            "worker",
            f"--pool={pool}",
            f"--concurrency={concurrency}",
            "--loglevel=INFO",
            f"--hostname={name}@%h",
            "--without-gossip",
            "--without-mingle",
            f"--include={include}",
            f"--queues={queues or self.queue}",
        ]
        if beat:  # django-celery-beat's DatabaseScheduler (the project's CELERY_BEAT_SCHEDULER)
            args.append("--beat")
        with open(self.tmp_path / f"{name}.log", "wb") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                args,
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the worker and its pool children: a crash, nothing cleaned up."""
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""
