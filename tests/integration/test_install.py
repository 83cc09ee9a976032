"""A new user's install, end to end (``tests/e2e/install.sh``): the wheel, a fresh
venv and ``startproject`` project, the README's install line, the quickstart's
files, a real worker and beat on Redis, starts until a 429, a completed run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "install.sh"
SKIPPED = 77

pytestmark = pytest.mark.install


def interpreter(version: str) -> str | None:
    """A Python ``version`` of this machine that runs: the running one, pyenv's, or one on PATH
    (a pyenv shim on PATH answers "command not found" for a version that is not selected)."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(pyenv.glob(f"{version}.*/bin/python{version}")) if pyenv.is_dir() else []
    found = shutil.which(f"python{version}")
    for python in [*map(str, reversed(candidates)), *([found] if found else [])]:
        probe = [python, "-c", "import sys; print(*sys.version_info[:2], sep='.')"]
        check = subprocess.run(probe, capture_output=True, text=True)
        if check.returncode == 0 and check.stdout.strip() == version:
            return python
    return None


@pytest.mark.parametrize(("version", "django"), [("3.11", "5.2"), ("3.12", "6.0")])
def test_a_new_project_installs_from_the_readme_and_runs_the_quickstart(version: str, django: str) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    result = subprocess.run(
        [str(SCRIPT), python], cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PIP_NO_INPUT": "1"}
    )
    if result.returncode == SKIPPED:
        pytest.skip("no package index can be reached")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"PASSED: Python {version}." in result.stdout and f"Django {django}." in result.stdout, result.stdout[-2000:]
    assert "turn 9: 429" in result.stdout  # 8 in flight (2 running, 6 pending), the ninth refused
