"""`kvmesh up` as its own process, the real CLI, for the tests that compare with it or drive it."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from kvmesh.launcher.compose import REPO_ROOT


@contextlib.contextmanager
def kvmesh_up(run_dir: Path, *flags: str, env: Mapping[str, str]) -> Iterator[tuple[subprocess.Popen, dict[str, dict]]]:
    """The mesh `kvmesh up FLAGS` runs (without the developer's compose/.env; its run folder ``run_dir``),
    once it printed its banner: the launcher and its plan (topology.json, by process name). SIGTERM after."""
    (run_dir / "empty.env").write_text("")
    argv = [sys.executable, "-m", "kvmesh.cli", "up", *flags, "--env-file", str(run_dir / "empty.env")]
    argv += ["--run-dir", str(run_dir)]
    with open(run_dir / "up.stderr", "w") as err:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=dict(env), stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("kvmesh is up"):
                break
        else:
            raise AssertionError(f"kvmesh up ended (code {proc.wait()}):\n{(run_dir / 'up.stderr').read_text()}")
        yield proc, {p["name"]: p for p in json.loads((run_dir / "topology.json").read_text())}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()  # the children follow it (parent-death signal)
            proc.wait()
