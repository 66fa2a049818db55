from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kvmesh.launcher import ProcessSpec
from kvmesh.launcher.compose import REPO_ROOT
from kvmesh.runtime.ports import free_port


def child(name: str, role: str, **settings: object) -> ProcessSpec:
    """A child_service process at ``role``'s start level; settings become KVMESH_* variables."""
    port = free_port()
    env = {"KVMESH_PORT": str(port), "KVMESH_METRICS_PORT": "0", "KVMESH_GRACE_SECONDS": "1", "PYTHONUNBUFFERED": "1"}
    env |= {"KVMESH_" + k.upper(): str(v) for k, v in settings.items()}
    return ProcessSpec(
        name, role, (sys.executable, "-m", "tests.launcher.child_service"), env, "127.0.0.1", port, workdir=REPO_ROOT
    )


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still alive after waiting up to ``timeout_s`` for all to end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def read_pid(path: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def kill_if_alive(pids: list[int]) -> None:
    """Test cleanup: never leave a process of ours behind, whatever failed."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, 9)
