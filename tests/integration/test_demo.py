"""The README's demo runs on the embedded default (SQLite, in-process worker)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

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
