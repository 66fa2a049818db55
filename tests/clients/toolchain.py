"""Running the clients' toolchains (go, node, tsc) from the pytest suite."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def require_tool(name: str) -> str:
    """The tool's path; the test fails (not skips) without it: CI installs every one."""
    path = shutil.which(name)
    assert path, f"{name} is not on PATH (scripts/install.sh sets up the client toolchains)"
    return path


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Runs cmd, failing the test with its output when it exits non-zero; returns the output."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out}"
    return out
