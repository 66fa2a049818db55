"""A local mesh as the supervisor runs it: processes (``ProcessSpec``) in start levels (``Topology``),
and the options ``kvmesh up``, the end-to-end tests and the benchmarks set on top of the compose file
(``MeshOptions``). ``kvmesh.launcher.topology`` builds a ``Topology`` from the compose file."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.launcher.compose import COMPOSE_FILE, ComposeFile, compose_variables, load_compose
from kvmesh.launcher.hosts import Place
from kvmesh.runtime.flags import parse_bool
from kvmesh.runtime.tls import TlsFiles

# Start levels of hand-built specs (tests, benchmarks); a compose plan takes its own from depends_on.
LEVELS = {"redis": 0, "router": 1, "kvstore": 2, "speculator": 2, "prefill": 3, "decode": 3, "gateway": 4}
KVMESH_ROLES = ("gateway", "router", "prefill", "decode", "kvstore", "speculator")
SCALED_ROLES = ("prefill", "decode")  # run as <service>-<i>, one worker id each
REDIS_PORT = 6379
PORT_SETTING = re.compile(r"KVMESH_(\w+)_PORT")  # a port the service listens on (KVMESH_HTTP_PORT...)


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # "router", "decode-0"
    role: str  # a LEVELS key
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the launcher's own environment
    host: str
    port: int
    metrics_port: int | None = None
    device: str | None = None
    netns: str | None = None  # the network namespace it runs in (a host of a multi-host mesh); None: the launcher's
    health: str = "grpc"  # "grpc" (grpc.health.v1, overall SERVING) or "redis" (PING)
    workdir: Path | None = None  # created before start; the process runs there
    start_level: int | None = None  # None: LEVELS[role]
    stop_grace_s: float | None = None  # SIGTERM to SIGKILL (None: the supervisor's default)
    # How the supervisor's health check gets in: its mesh identity (mutual TLS) and Redis's password.
    health_identity: TlsFiles | None = None
    redis_password_file: Path | None = None

    @property
    def level(self) -> int:
        return LEVELS[self.role] if self.start_level is None else self.start_level

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Topology:
    processes: tuple[ProcessSpec, ...]
    # The mesh's CA and role certificates (kvmesh.runtime.certs), made before anything starts; None: plaintext.
    certs: Path | None = None

    def __post_init__(self) -> None:
        names = [p.name for p in self.processes]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique: {names}")

    def get(self, name: str) -> ProcessSpec:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r}; have {[p.name for p in self.processes]}")

    def levels(self) -> list[list[ProcessSpec]]:
        """Processes grouped by start level, lowest first."""
        by_level: dict[int, list[ProcessSpec]] = {}
        for p in self.processes:
            by_level.setdefault(p.level, []).append(p)
        return [by_level[k] for k in sorted(by_level)]


@dataclass(frozen=True)
class MeshOptions:
    """Overrides on top of the compose file; None everywhere means "as the compose file says"."""

    model: Path | None = None  # None: the compose file's model mount (its host folder)
    # A hub id's model (kvmesh.models.sources): the processes get the id and the snapshot's commit as their
    # --model and --revision, so each serves and labels it by its id and all serve one snapshot.
    hub_id: str | None = None
    commit: str | None = None
    model_name: str | None = None
    prefill: int | None = None  # workers; None: the compose file's replicas (0: decode prefills)
    decode: int | None = None
    speculator: bool = True
    # Mutual TLS between the services and a password on Redis, as the compose file sets them up
    # (its certs service); False (`kvmesh up --insecure`): plaintext, for debugging.
    tls: bool = True
    host: str = "127.0.0.1"
    # Process name -> the host it runs on (kvmesh.launcher.netns.Network.placement); None: all on ``host``.
    placement: Mapping[str, Place] | None = None
    gateway_port: int | None = None  # None: the compose file's published port; 0: a free port
    # True: ports the compose file publishes keep their host port here (gateway gRPC 50051, HTTP 8000);
    # False: they get free (or base_port) ports like the rest, so meshes can run side by side.
    publish: bool = True
    # Every other port (gRPC and metrics, gateway metrics included) is
    # base_port, base_port + 1, ... in process order; None: free ports.
    base_port: int | None = None
    redis_port: int | None = None  # None: from base_port, or free
    # Comma-separated devices, handed out to the workers round-robin:
    # "cuda:0,cuda:1" with prefill=2 puts one worker on each. None: the
    # compose file's GPU reservation (cuda:N), or cpu on a machine without GPUs.
    # The Python API keeps the CPU default it always had; `kvmesh up` passes None.
    device_prefill: str | None = "cpu"
    device_decode: str | None = "cpu"
    log_level: str | None = None
    grace_seconds: float | None = None  # each service's drain limit on SIGTERM
    python: str = sys.executable
    redis_server: str = "redis-server"
    redis_persistence: bool = False  # a local mesh is throwaway: Redis keeps nothing unless asked
    # Extra KVMESH_* settings per role, e.g. {"decode": {"KVMESH_NUM_BLOCKS": "256"}}.
    role_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    compose_file: Path = COMPOSE_FILE
    # What ${VAR} in the compose file sees; None: its .env, then the environment (as Compose does).
    compose_vars: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if (self.prefill is not None and self.prefill < 0) or (self.decode is not None and self.decode < 1):
            raise ValueError(
                f"need at least one decode worker and no negative counts (prefill={self.prefill}, decode={self.decode})"
            )

    def load_compose(self) -> ComposeFile:
        variables = compose_variables(self.compose_file) if self.compose_vars is None else self.compose_vars
        return load_compose(self.compose_file, variables)


def local_gpu_count() -> int:
    """GPUs NVML sees on this machine (0 without a driver)."""
    from kvmesh.runtime.gpu import gpu_stats

    return len(gpu_stats())


def describe(topology: Topology, run_dir: Path) -> Sequence[str]:
    """The endpoints, one line per process, for people."""
    lines = []
    if topology.certs is not None:
        lines.append(f"  mutual TLS between services; CA and role certificates in {topology.certs}")
    for p in topology.processes:
        where = f"redis://{p.address}/0" if p.health == "redis" else f"gRPC {p.address}"
        others = "".join(
            f"  {m.group(1).lower()} {p.host}:{v}"
            for k, v in p.env.items()
            if (m := PORT_SETTING.fullmatch(k)) and m.group(1) != "METRICS"
        )
        metrics = f"  metrics http://{p.host}:{p.metrics_port}/metrics" if p.metrics_port else ""
        device = f"  device {p.device}" if p.device else ""
        steps = f"  {decode_steps(p)} decode steps" if p.role == "decode" else ""
        degree = p.env.get("KVMESH_TENSOR_PARALLEL_SIZE", "1") if p.role in ("prefill", "decode") else "1"
        steps += f"  {degree} tensor-parallel ranks" if degree != "1" else ""
        log = f"  log {run_dir / 'logs' / (p.name + '.log')}"
        lines.append(f"  {p.name:<12} {where:<24}{others}{metrics}{device}{steps}{log}")
    return lines


def worker_role_env(
    deterministic: bool = False, prefill_tp: int | None = None, decode_tp: int | None = None
) -> dict[str, dict[str, str]]:
    """The workers' settings ``kvmesh up --deterministic --prefill-tp A --decode-tp B`` asks for (as
    ``MeshOptions.role_env``). Deterministic: both kinds of worker, or KV would pass between differently
    rounded ones. Tensor-parallel degrees may differ: blocks travel whole (docs/tensor_parallel.md); a
    degree not asked for (None) is the compose file's."""
    env: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    for role, degree in (("prefill", prefill_tp), ("decode", decode_tp)):
        if deterministic:
            env[role]["KVMESH_DETERMINISTIC"] = "1"
        if degree is not None:
            env[role]["KVMESH_TENSOR_PARALLEL_SIZE"] = str(degree)
    return {role: settings for role, settings in env.items() if settings}


def decode_steps(p: ProcessSpec) -> str:
    """How a decode worker runs its decode steps ("compiled", "eager" or "deterministic eager"): its
    --compile and --deterministic, each from its settings, else the launcher's environment, else the
    flag's default (compile on: engine.flags.COMPILE_FLAG; deterministic off)."""
    try:
        if _setting(p, "KVMESH_DETERMINISTIC", "0"):
            return "deterministic eager"
        return "compiled" if _setting(p, "KVMESH_COMPILE", "1") else "eager"
    except ValueError as e:
        return str(e)


def _setting(p: ProcessSpec, name: str, default: str) -> bool:
    """A boolean setting of ``p`` as its process will read it; ValueError naming it if it is not one."""
    raw = p.env.get(name, os.environ.get(name, default))
    try:
        return parse_bool(raw)
    except ValueError:
        raise ValueError(f"invalid {name}={raw!r}") from None
