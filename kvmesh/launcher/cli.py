"""``kvmesh up``: start the whole mesh here as the compose file describes it, print the endpoints,
stop it all on Ctrl-C/SIGTERM.

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
from dataclasses import replace
from pathlib import Path

from kvmesh.errors import ModelLoadError
from kvmesh.launcher.compose import COMPOSE_FILE, ComposeError, compose_variables
from kvmesh.launcher.hosts import HostsFile
from kvmesh.launcher.multihost import plan_on_hosts
from kvmesh.launcher.netns import Network, NetworkError, can_make_hosts
from kvmesh.launcher.restart import RestartPolicy
from kvmesh.launcher.spec import MeshOptions, Topology, describe, worker_role_env
from kvmesh.launcher.supervisor import Mesh, MeshError, StartInterrupted
from kvmesh.launcher.topology import build_topology, compose_model_path
from kvmesh.models.sources import REVISION_HELP, ModelSource, resolve_source


def add_up_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "up",
        help="start the whole mesh on this machine as separate processes, as compose/docker-compose.yml describes it "
        "(Ctrl-C stops it)",
    )
    p.add_argument(
        "--compose-file", type=Path, default=COMPOSE_FILE, help="the mesh's description (default: %(default)s)"
    )
    p.add_argument(
        "--env-file", type=Path, help="values for its ${VAR}s (default: .env beside it; the environment wins)"
    )
    p.add_argument(
        "--model",
        help="a local Hugging Face model folder, or a hub id (org/name) in the Hugging Face cache, offline "
        "(default: the compose file's model folder, KVMESH_MODEL_DIR; the embedded default model when that "
        "is the shipped one and missing)",
    )
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument(
        "--model-name", help="model id the gateway serves (default: a hub id as given, else the folder's name)"
    )
    p.add_argument(
        "--prefill-replicas",
        "--prefill",
        dest="prefill",
        type=int,
        metavar="N",
        help="prefill workers (default: the compose file's replicas; 0: decode prefills)",
    )
    p.add_argument(
        "--decode-replicas",
        "--decode",
        dest="decode",
        type=int,
        metavar="M",
        help="decode workers (default: the compose file's replicas); 2 or more: a dead one's streams "
        "migrate to the others",
    )
    p.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a process that exits unexpectedly, with exponential backoff (default on)",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=RestartPolicy.initial_backoff_s,
        metavar="S",
        help="seconds before the first restart; doubled for each crash in a row (default: %(default)s)",
    )
    p.add_argument(
        "--restart-backoff-max",
        type=float,
        default=RestartPolicy.max_backoff_s,
        metavar="S",
        help="the longest wait between restarts (default: %(default)s)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        metavar="K",
        help="restarts in a row (each crashing before it ran --restart-stable-after) before giving up "
        "on a crash-looping process (default: %(default)s)",
    )
    p.add_argument(
        "--restart-stable-after",
        type=float,
        default=RestartPolicy.stable_after_s,
        metavar="S",
        help="a run this long resets the backoff and the crash count (default: %(default)s)",
    )
    p.add_argument(
        "--speculator", action=argparse.BooleanOptionalAction, default=True, help="run the speculator (default on)"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="prefill and decode workers run batch-invariant (their --deterministic; docs/determinism.md)",
    )
    p.add_argument(
        "--prefill-tp",
        type=int,
        metavar="A",
        help="tensor-parallel ranks of each prefill worker (their --tensor-parallel-size; docs/tensor_parallel.md); "
        "default: the compose file's KVMESH_PREFILL_TP, else 1",
    )
    p.add_argument("--decode-tp", type=int, metavar="B", help="tensor-parallel ranks of each decode worker (likewise)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext between the services and no Redis password (debugging; default: mutual TLS "
        "with a CA and certificates made in the run folder, docs/security.md)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address every service binds to")
    p.add_argument(
        "--hosts",
        type=Path,
        help="a hosts file (compose/hosts.yml): run each process on the host it names, every host a network "
        "namespace with its own address on a private bridge (Linux, root), KV between hosts over TCP",
    )
    p.add_argument(
        "--gateway-port",
        type=int,
        help="the gateway's public gRPC port (default: the compose file's published port, 50051; 0: a free one)",
    )
    p.add_argument(
        "--publish",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ports the compose file publishes keep their host port (gateway gRPC 50051, HTTP 8000); "
        "--no-publish: free ports like the rest, to run meshes side by side",
    )
    p.add_argument(
        "--base-port", type=int, help="first of the consecutive ports for everything else (default: free ports)"
    )
    p.add_argument("--redis-port", type=int, help="Redis port (default: from --base-port, or a free one)")
    p.add_argument(
        "--device",
        help="device of every prefill and decode worker, e.g. cpu (default: the compose "
        "file's GPU pins as cuda:N, or cpu on a machine without GPUs)",
    )
    p.add_argument(
        "--device-prefill", help="device(s) of the prefill workers, comma-separated, round-robin (overrides --device)"
    )
    p.add_argument(
        "--device-decode", help="device(s) of the decode workers, comma-separated, round-robin (overrides --device)"
    )
    p.add_argument(
        "--redis-persistence",
        action="store_true",
        help="keep the compose file's Redis persistence (default: off locally)",
    )
    p.add_argument("--redis-server", default="redis-server", help="the redis-server binary")
    p.add_argument(
        "--run-dir", help="where logs, Redis's directory and the named volumes go (default: a new temporary directory)"
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="(default: the compose file's)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for every process to become healthy")
    p.add_argument(
        "--stop-timeout",
        type=float,
        help="seconds a process may take to stop before SIGKILL (default: its stop_grace_period in the compose file)",
    )
    p.set_defaults(func=run_up)
    return p


def run_up(args: argparse.Namespace) -> int:
    redis = shutil.which(args.redis_server)
    if redis is None:
        _say(f"{args.redis_server} not found on PATH (Debian: apt-get install redis-server)")
        return 2
    compose_file = args.compose_file.expanduser().resolve()
    try:
        variables = compose_variables(compose_file, args.env_file)
        options = MeshOptions(
            model_name=args.model_name,
            prefill=args.prefill,
            decode=args.decode,
            speculator=args.speculator,
            tls=not args.insecure,
            host=args.host,
            gateway_port=args.gateway_port,
            publish=args.publish,
            base_port=args.base_port,
            redis_port=args.redis_port,
            device_prefill=args.device_prefill or args.device,
            device_decode=args.device_decode or args.device,
            log_level=args.log_level,
            redis_server=redis,
            redis_persistence=args.redis_persistence,
            compose_file=compose_file,
            compose_vars=variables,
            role_env=worker_role_env(args.deterministic, args.prefill_tp, args.decode_tp),
        )
        source, label = _resolve_model(args.model, args.revision, options)
        if source is None:
            return 2
        model = source.path
        options = replace(options, model=model, hub_id=source.hub_id, commit=source.commit)
        run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="kvmesh-run-"))
        network, topology = _plan(args, options, run_dir)
        policy = (
            RestartPolicy(
                initial_backoff_s=args.restart_backoff,
                max_backoff_s=args.restart_backoff_max,
                max_restarts=args.max_restarts,
                stable_after_s=args.restart_stable_after,
            )
            if args.restart
            else None
        )
    except ValueError as e:  # ComposeError included
        _say(str(e))
        return 2
    _say(f"topology from {compose_file}; run dir {run_dir} (logs in {run_dir / 'logs'})")
    mesh = Mesh(
        topology,
        run_dir,
        start_timeout_s=args.start_timeout,
        stop_timeout_s=args.stop_timeout,
        on_progress=_say,
        restart=policy,
    )
    banner = [f"kvmesh is up: model {args.model_name or source.name} ({model})" + (f" -- {label}" if label else "")]
    banner = [*banner, *describe(topology, run_dir), "Ctrl-C stops the mesh."]
    if network is None:
        return serve_mesh(mesh, banner)
    try:
        network.create()
    except NetworkError as e:
        _say(f"--hosts: {e}")
        return 1
    try:
        return serve_mesh(mesh, banner)
    finally:
        network.remove()


def _plan(args: argparse.Namespace, options: MeshOptions, run_dir: Path) -> tuple[Network | None, Topology]:
    """The mesh's processes, on the hosts of ``--hosts`` (and that network, not made yet) or all here."""
    if args.hosts is None:
        return None, build_topology(options, run_dir)
    why_not = can_make_hosts()
    if why_not is not None:
        raise ComposeError(f"--hosts: {why_not}")
    return plan_on_hosts(options, run_dir, HostsFile.load(args.hosts))


def serve_mesh(mesh: Mesh, banner: Sequence[str]) -> int:
    """Start ``mesh``, print ``banner``, serve until SIGINT/SIGTERM, stop it all; the exit code.

    A process that crashes after start-up is reported with its last log lines
    and the rest keep serving (as ``docker compose`` does: the mesh is built to
    lose a worker); a supervising mesh (``RestartPolicy``) restarts it and
    reports that itself. The exit code is then 1.
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
            if mesh.supervised:
                _say(f"{name} stays down; the rest keep serving")
            else:
                _say(
                    f"{name} exited unexpectedly (code {code}); the rest keep serving. "
                    f"Its last log lines:\n{mesh.log_tail(name)}"
                )
        _say("stopping the mesh (a second Ctrl-C kills it at once)")
        restarted = any(mesh.restarts(p.name) for p in mesh.topology.processes)
        return 1 if crashed or restarted else 0
    finally:
        mesh.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _say("stopped")


def _resolve_model(
    flag: str | None, revision: str | None, options: MeshOptions
) -> tuple[ModelSource | None, str | None]:
    """The model every service gets (a folder, or a hub id's snapshot in the HF cache), and its kvmesh label
    if it has one; None: reported."""
    if flag is not None:
        try:
            source = resolve_source(flag, revision)
        except ModelLoadError as e:
            _say(e.message)
            return None, None
        if source.hub_id is None:
            source = ModelSource(source.path.resolve())
        return source, _label(source.path)
    if revision is not None:
        _say(f"--revision {revision} needs a hub id --model")
        return None, None
    path = compose_model_path(options)
    if path is not None and path.is_dir():
        return ModelSource(path), _label(path)
    if path is not None and path != compose_model_path(replace(options, compose_vars={})):
        _say(f"the compose file's model folder {path} (KVMESH_MODEL_DIR) is not a directory; fix it or give --model")
        return None, None
    from kvmesh.engine.default_model import default_model_path

    # The compose file's default folder is missing here (KVMESH_MODELS_DIR moved the model cache,
    # say): the installed default model stands in, or the error says how to install it.
    try:
        default = default_model_path()
    except ModelLoadError as e:
        _say(e.message)
        return None, None
    _say(f"no --model and no {path}: serving the installed default model {default}")
    return ModelSource(default), _label(default)


def _label(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("kvmesh_label")
    except (OSError, ValueError):
        return None  # the services report a broken config themselves


def _say(message: str) -> None:
    print(f"kvmesh: {message}", file=sys.stderr, flush=True)
