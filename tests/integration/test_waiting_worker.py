"""Sleep, signals, children and remote queues on real Celery workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings

from durable import RunStatus, engine
from durable.testing import wait_for
from testproject.celery import app as celery_app
from tests.remote_service import REMOTE_QUEUE

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "durable-waiting-test"


@pytest.mark.django_db(transaction=True)
def test_child_and_signal_on_the_in_process_worker(celery_worker: Any) -> None:
    parent = engine.start("test.approval_parent", {"n": 7})
    wait_for(lambda: parent.refresh().record.waiting_for == "signal:decision", timeout=20, what="the signal wait")
    [child] = engine.list_runs(workflow="test.child_echo")
    assert child.status == RunStatus.COMPLETED and child.record.parent_run_id == parent.run_id
    parent.signal("decision", {"ok": True})
    assert parent.result(timeout=20) == {"child": {"echo": {"n": 7}}, "decision": {"ok": True}}


# -- worker subprocesses -----------------------------------------------------------------------


@pytest.fixture
def worker_env(settings: Any) -> dict[str, str]:
    broker = celery_app.conf.broker_url
    if not broker.startswith("redis://"):
        pytest.skip("needs a Redis broker shared with worker processes: set CELERY_BROKER_URL")
    db = django_settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("needs PostgreSQL shared with worker processes: set DATABASE_URL")
    settings.DURABLE = {**settings.DURABLE, "TASK_QUEUE": QUEUE}
    celery_app.control.purge()
    return {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "DURABLE_HEARTBEAT_INTERVAL": "0.2",
        "DURABLE_STALE_AFTER": "2",
        "DURABLE_SWEEP_INTERVAL": "0.5",
        "DURABLE_TASK_QUEUE": QUEUE,
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str], name: str, *, queues: str, include: str, beat: bool = False) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "celery", "-A", "testproject", "worker", "--pool=solo", "--loglevel=INFO",
                f"--hostname={name}@%h", "--without-gossip", "--without-mingle", f"--include={include}",
                f"--queues={queues}"]  # fmt: skip
        if beat:
            args.append("--beat")
        log = open(tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_sleep_survives_every_worker_restarting(worker_env: dict[str, str], workers: Any, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    lines = lambda: log.read_text().split() if log.exists() else []  # noqa: E731
    first = workers(worker_env, "first", queues=QUEUE, include="tests.waiting")
    handle = engine.start("test.sleeper", {"log": str(log), "seconds": 3})
    wait_for(lambda: handle.refresh().status == RunStatus.SUSPENDED, timeout=30, what="the run to go to sleep")
    wake_at = handle.record.wake_at
    assert wake_at is not None and handle.record.waiting_for == "sleep"

    # The only worker dies while the run sleeps (its timer message dies with it).
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    workers(worker_env, "second", queues=QUEUE, include="tests.waiting", beat=True)

    assert handle.result(timeout=60) == "slept"
    assert lines() == ["before", "after"]
    assert handle.record.finished_at >= wake_at


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_blocked_remote_run_resumes_when_a_worker_for_its_queue_starts(
    worker_env: dict[str, str], workers: Any
) -> None:
    engine.register_remote("test.remote_echo", "1", queue=REMOTE_QUEUE)
    try:
        handle = engine.start("test.remote_echo", {"x": 1})
        assert handle.record.queue == REMOTE_QUEUE
        swept = engine.sweep()  # asks the live workers: none consumes the remote queue
        assert handle.run_id in swept["blocked"]
        assert handle.refresh().status == RunStatus.BLOCKED

        # The other service starts a worker on its queue: the run goes by itself.
        workers(worker_env, "remote", queues=REMOTE_QUEUE, include="tests.remote_service")
        assert handle.result(timeout=60) == {"served_by": "remote", "echo": {"x": 1}}
    finally:
        engine.registry.unregister("test.remote_echo")
