"""A launcher process for the tests: ``serve_mesh`` over two child services, the way ``kvmesh up`` runs a mesh.

``python -m tests.launcher.run_mesh DIR [START_DELAY_S [restart]]``: the children write their pids to DIR/<name>.pid;
``restart`` supervises them (a quick ``RestartPolicy``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvmesh.launcher import Mesh, RestartPolicy, Topology
from kvmesh.launcher.cli import serve_mesh
from tests.launcher.helpers import child


def main() -> None:
    work = Path(sys.argv[1])
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    policy = RestartPolicy(initial_backoff_s=0.2) if sys.argv[3:4] == ["restart"] else None
    topology = Topology(
        (
            child("router", "router", pid_file=work / "router.pid"),
            child("gateway", "gateway", pid_file=work / "gateway.pid", start_delay_s=delay),
        )
    )
    sys.exit(serve_mesh(Mesh(topology, work / "run", restart=policy, on_progress=_say), ["the test mesh is up"]))


def _say(message: str) -> None:
    print(f"kvmesh: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
