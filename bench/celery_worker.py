"""A real Celery worker for sections (d), (f) and (g): a ``celery -A testproject worker`` subprocess.

It runs the test project (its settings read ``DATABASE_URL``, ``CELERY_BROKER_URL``
and ``DURABLE_TASK_QUEUE``), points at the scratch database, consumes one queue of
its own, and imports ``bench.handoff`` (``--include``). Used as a context manager,
it is stopped at the end also on error or Ctrl-C: SIGTERM to its process group
(a warm shutdown), then SIGKILL when it has not exited in time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Self

from bench.pool import WorkerError

ROOT = Path(__file__).resolve().parents[1]


class WorkerProcess:
    """A worker command in a process group of its own, its output in a temporary log.

    Used as a context manager it is started, and stopped at the end also on error or
    Ctrl-C: SIGTERM to its process group (a warm shutdown), then SIGKILL when it has
    not exited within ``stop_timeout`` seconds. The log is kept when an error ended it.
    Subclasses give ``name``, ``command`` and ``extra_env``.
    """

    name = "worker"

    def __init__(self, *, stop_timeout: float = 20.0) -> None:
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        fd, log = tempfile.mkstemp(prefix="durable-bench-worker-", suffix=".log")
        os.close(fd)
        self.log = Path(log)

    @property
    def command(self) -> list[str]:
        raise NotImplementedError

    def extra_env(self) -> dict[str, str]:
        return {}

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop(keep_log=exc is not None)

    def start(self) -> None:
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, **self.extra_env(), "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def check(self) -> None:
        """Raise ``WorkerError`` (with the end of its log) if the worker has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise WorkerError(f"the {self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:]) + f"\n(log: {self.log})"

    def stop(self, *, keep_log: bool = False) -> None:
        """SIGTERM to the worker's process group, SIGKILL after ``stop_timeout`` seconds."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            except ProcessLookupError:  # it exited in between
                proc.wait(timeout=10)
        if not keep_log:
            self.log.unlink(missing_ok=True)


class CeleryWorker(WorkerProcess):
    name = "Celery worker"

    def __init__(
        self,
        *,
        broker: str,
        database_url: str,
        queue: str,
        pool: str = "threads",
        concurrency: int = 1,
        include: str = "bench.handoff",
        stop_timeout: float = 20.0,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(stop_timeout=stop_timeout)
        self.broker, self.database_url, self.queue = broker, database_url, queue
        self.pool, self.concurrency, self.include = pool, concurrency, include
        self.env = env or {}

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "testproject",
            "worker",
            f"--pool={self.pool}",
            f"--concurrency={self.concurrency}",
            "--loglevel=WARNING",
            f"--hostname=durable-bench-{os.getpid()}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--include={self.include}",
            f"--queues={self.queue}",
        ]

    def describe(self) -> str:
        return f"celery -A testproject worker --pool={self.pool} --concurrency={self.concurrency}, queue {self.queue}"

    def extra_env(self) -> dict[str, str]:
        return {
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": self.broker,
            "DURABLE_TASK_QUEUE": self.queue,
            # As in production: DEBUG would also make Django keep every query it sends.
            "DJANGO_DEBUG": "0",
            **self.env,
        }
