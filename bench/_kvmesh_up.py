"""`kvmesh up` as the benchmarks start it: the real CLI, timed from its start to its banner, stopped after."""

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

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Up:
    started_at: float  # time.monotonic() when the CLI was started
    healthy_s: float  # to its banner: every health check passed
    http_port: int  # the gateway's OpenAI API
    stop_s: float = 0.0  # SIGTERM to exit, set once the block is left


@contextlib.contextmanager
def kvmesh_up(run_dir: Path, env: Mapping[str, str], *flags: str) -> Iterator[Up]:
    """The default mesh on the CPU (no published ports, no compose/.env), its run folder ``run_dir``."""
    (run_dir / "empty.env").write_text("")
    argv = [sys.executable, "-m", "kvmesh.cli", "up", "--device", "cpu", "--no-publish", "--log-level", "warning"]
    argv += ["--env-file", str(run_dir / "empty.env"), "--run-dir", str(run_dir), *flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    up = None
    try:
        assert proc.stdout is not None
        if not any(line.startswith("kvmesh is up") for line in proc.stdout):
            raise RuntimeError(f"kvmesh up ended with {proc.wait()}")
        healthy = time.monotonic() - t0
        plan = {p["name"]: p for p in json.loads((run_dir / "topology.json").read_text())}
        up = Up(t0, healthy, int(plan["gateway"]["env"]["KVMESH_HTTP_PORT"]))
        yield up
    finally:
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        if up is not None:
            up.stop_s = time.monotonic() - t1
