"""`kvmesh up` as a child process, the real CLI: what the tests that drive it and the start-up benchmarks run."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvmesh.launcher.compose import REPO_ROOT


@dataclass
class UpProcess:
    proc: subprocess.Popen
    plan: dict[str, dict]  # topology.json, by process name
    started_at: float  # time.monotonic() when the CLI was started
    healthy_s: float  # from then to its banner: every health check passed
    stop_s: float = 0.0  # SIGTERM to exit, set once the block is left

    @property
    def http_port(self) -> int:
        """The gateway's OpenAI API."""
        return int(self.plan["gateway"]["env"]["KVMESH_HTTP_PORT"])


@contextlib.contextmanager
def kvmesh_up(run_dir: Path, *flags: str, env: Mapping[str, str]) -> Iterator[UpProcess]:
    """The mesh `kvmesh up FLAGS` runs (without the developer's compose/.env; its run folder ``run_dir``, its
    stderr in ``up.stderr`` there), once it printed its banner. SIGTERM after (SIGKILL past 90 s)."""
    (run_dir / "empty.env").write_text("")
    argv = [sys.executable, "-m", "kvmesh.cli", "up", *flags, "--env-file", str(run_dir / "empty.env")]
    argv += ["--run-dir", str(run_dir)]
    started_at = time.monotonic()
    with open(run_dir / "up.stderr", "w") as err:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=dict(env), stdout=subprocess.PIPE, stderr=err, text=True)
    up = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("kvmesh is up"):
                break
        else:
            raise RuntimeError(f"kvmesh up ended (code {proc.wait()}):\n{(run_dir / 'up.stderr').read_text()}")
        healthy_s = time.monotonic() - started_at
        plan = {p["name"]: p for p in json.loads((run_dir / "topology.json").read_text())}
        up = UpProcess(proc, plan, started_at, healthy_s)
        yield up
    finally:
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()  # the children follow it (parent-death signal)
            proc.wait()
        if up is not None:
            up.stop_s = time.monotonic() - stopping
