"""What the benchmarks that run several meshes side by side share (bench/tls.py, bench/tracing.py): the
round flags, a mesh started and ready for HTTP, and prompts made unique to their round."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from peers import wait_ready

from kvmesh.launcher.spec import MeshOptions
from kvmesh.launcher.supervisor import Mesh
from kvmesh.launcher.topology import Topology, build_topology


def round_flags(parser: argparse.ArgumentParser) -> None:
    """--model, --streams, --max-tokens, --rounds, --json."""
    parser.add_argument("--model", type=Path, help="model folder (default: the installed default model)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="per mode, alternating")
    parser.add_argument("--json", help="write the results here")


@contextlib.contextmanager
def running_mesh(opts: MeshOptions, workdir: Path, prefix: str) -> Iterator[tuple[str, Mesh, Topology]]:
    """``opts``'s mesh in a run folder under ``workdir``, for the block: its HTTP base URL once the gateway
    answers, the running mesh and its topology."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))
    topology = build_topology(opts, run_dir)
    with Mesh(topology, run_dir) as running:
        url = f"http://127.0.0.1:{topology.get('gateway').env['KVMESH_HTTP_PORT']}"
        wait_ready(url, None, run_dir / "logs")
        yield url, running, topology


def unique(prompts: list[list[int]], round_no: int) -> list[list[int]]:
    """The prompts with a token of this round in front: nothing of an earlier round's prefix is cached."""
    return [[1000 + round_no, *p] for p in prompts]
