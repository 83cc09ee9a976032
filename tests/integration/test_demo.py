"""The README's demo runs on the embedded default (SQLite, in-process worker)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_demo_accepts_8_refuses_4_then_accepts_again_and_skips_a_full_window(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "CELERY_BROKER_URL"}}
    env["SQLITE_PATH"] = str(tmp_path / "demo.sqlite3")
    result = subprocess.run(
        [sys.executable, "manage.py", "demo", "--no-serve", "--port", str(free_port()), "--think", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count(" 201  accepted") == 8 + 2
    assert out.count(" 429  busy       Retry-After: 1s  active 8/8 on tenant:acme") == 4
    assert out.count("completed  {'reply': 'echo: hello #") == 8
    assert "8 accepted, 4 refused with 429, then accepted again." in out
    # The schedule "acme-digest" (its own quota: tenant:acme, limit 8) fires while the tenant is full.
    assert "8 long turns fill tenant:acme (8 active of 8)" in out
    assert "UTC skipped, no run started." in out
    assert (
        "  last_error: Window 20" in out
        and "skipped: concurrency key 'tenant:acme' is full (8 of 8 runs in flight), so no run was started." in out
    )
    assert "/admin/durable/schedule/" in out


def test_a_taken_port_given_with_port_is_a_clear_error_without_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "CELERY_BROKER_URL"}}
    env["SQLITE_PATH"] = str(tmp_path / "demo.sqlite3")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "manage.py", "demo", "--no-serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert result.returncode == 1
    assert f"Cannot serve on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "Traceback" not in result.stderr


def test_without_port_a_taken_default_port_falls_back_to_a_free_one(monkeypatch: Any) -> None:
    from testproject.chat.management.commands import demo

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(demo, "DEFAULT_PORT", taken.getsockname()[1])
        command = demo.Command(stdout=io.StringIO())
        server = command._server(None)
        try:
            chosen = server.server_address[1]
            assert chosen != taken.getsockname()[1]
            assert f"serving on {chosen} (choose one with --port)" in command.stdout._out.getvalue()
        finally:
            server.server_close()
