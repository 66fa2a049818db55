"""``kvmesh up``: start the whole mesh here, print the endpoints, stop it all on Ctrl-C/SIGTERM.

``kvmesh/cli.py`` wires it in with ``add_up_parser(subparsers)``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvmesh.launcher.supervisor import Mesh, MeshError, StartInterrupted
from kvmesh.launcher.topology import MeshOptions, build_topology, describe


def add_up_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("up", help="start the whole mesh on this machine as separate processes (Ctrl-C stops it)")
    p.add_argument("--model", help="local Hugging Face model folder (default: the embedded default model, RANDOM weights)")
    p.add_argument("--model-name", help="model id the gateway serves (default: the folder's name)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1; 0: decode prefills)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    p.add_argument("--speculator", action=argparse.BooleanOptionalAction, default=True, help="run the speculator (default on)")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds to")
    p.add_argument("--gateway-port", type=int, default=50051, help="the gateway's public gRPC port (0: a free one)")
    p.add_argument("--base-port", type=int, help="first of the consecutive ports for everything else (default: free ports)")
    p.add_argument("--redis-port", type=int, help="Redis port (default: from --base-port, or a free one)")
    p.add_argument("--device-prefill", default="cpu", help="device(s) of the prefill workers, comma-separated, round-robin")
    p.add_argument("--device-decode", default="cpu", help="device(s) of the decode workers, comma-separated, round-robin")
    p.add_argument("--redis-server", default="redis-server", help="the redis-server binary")
    p.add_argument("--run-dir", help="where logs and Redis's directory go (default: a new temporary directory)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for every process to become healthy")
    p.add_argument("--stop-timeout", type=float, default=20.0, help="seconds a process may take to stop before SIGKILL")
    p.set_defaults(func=run_up)
    return p


def run_up(args: argparse.Namespace) -> int:
    model, label = _resolve_model(args.model)
    if model is None:
        _say(f"--model {args.model}: not a directory")
        return 2
    redis = shutil.which(args.redis_server)
    if redis is None:
        _say(f"{args.redis_server} not found on PATH (Debian: apt-get install redis-server)")
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="kvmesh-run-"))
    options = MeshOptions(
        model=model,
        model_name=args.model_name,
        prefill=args.prefill,
        decode=args.decode,
        speculator=args.speculator,
        host=args.host,
        gateway_port=args.gateway_port,
        base_port=args.base_port,
        redis_port=args.redis_port,
        device_prefill=args.device_prefill,
        device_decode=args.device_decode,
        log_level=args.log_level,
        redis_server=redis,
    )
    try:
        topology = build_topology(options, run_dir)
    except ValueError as e:
        _say(str(e))
        return 2
    _say(f"run dir {run_dir} (logs in {run_dir / 'logs'})")
    mesh = Mesh(topology, run_dir, start_timeout_s=args.start_timeout, stop_timeout_s=args.stop_timeout, on_progress=_say)
    banner = [f"kvmesh is up: model {args.model_name or model.name} ({model})" + (f" -- {label}" if label else "")]
    return serve_mesh(mesh, [*banner, *describe(topology, run_dir), "Ctrl-C stops the mesh."])


def serve_mesh(mesh: Mesh, banner: Sequence[str]) -> int:
    """Start ``mesh``, print ``banner``, serve until SIGINT/SIGTERM, stop it all; the exit code.

    A process that crashes after start-up is reported with its last log lines
    and the rest keep serving (as ``docker compose`` does: the mesh is built to
    lose a worker); the exit code is then 1.
    """
    previous = {sig: signal.signal(sig, lambda *_: mesh.interrupt()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            mesh.start()
        except StartInterrupted:
            _say("stopped during start-up")
            return 0
        except MeshError as e:
            _say(f"{e}; stopped the mesh. Its last log lines:\n{e.log_tail}")
            return 1
        print("\n".join(banner), flush=True)
        crashed: list[str] = []
        while (name := mesh.wait(known=crashed)) is not None:
            crashed.append(name)
            code = mesh.process(name).popen.returncode
            _say(f"{name} exited unexpectedly (code {code}); the rest keep serving. Its last log lines:\n{mesh.log_tail(name)}")
        _say("stopping the mesh (a second Ctrl-C kills it at once)")
        return 1 if crashed else 0
    finally:
        mesh.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _say("stopped")


def _resolve_model(flag: str | None) -> tuple[Path | None, str | None]:
    """The model folder every service gets, and its kvmesh label if it has one (random weights)."""
    if flag is None:
        from kvmesh.engine.default_model import RANDOM_MODEL_LABEL, default_model_path

        _say(f"no --model: serving the embedded default model: {RANDOM_MODEL_LABEL}")
        # Written once here, so the services starting together never race to write it.
        return default_model_path(), RANDOM_MODEL_LABEL
    path = Path(flag).expanduser().resolve()
    if not path.is_dir():
        return None, None
    try:
        label = json.loads((path / "config.json").read_text()).get("kvmesh_label")
    except (OSError, ValueError):
        label = None  # the services report a broken config themselves
    return path, label


def _say(message: str) -> None:
    print(f"kvmesh: {message}", file=sys.stderr, flush=True)
