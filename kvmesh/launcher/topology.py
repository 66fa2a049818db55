"""What a local mesh is made of: every process, its command, environment, ports and device.

Pure: ``build_topology`` decides everything up front (ports included), so the
supervisor only starts what it is given and tests can check the plan without
starting anything.

Services are configured through their ``KVMESH_*`` environment twins rather
than flags: a service ignores a variable it does not define, so the launcher
does not break when a service drops or has not yet grown a setting.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Start order: a level starts once every lower level is healthy; stop goes in reverse.
LEVELS = {"redis": 0, "router": 1, "kvstore": 2, "speculator": 2, "prefill": 3, "decode": 3, "gateway": 4}

REPO_ROOT = Path(__file__).resolve().parents[2]


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
    health: str = "grpc"  # "grpc" (grpc.health.v1, overall SERVING) or "redis" (PING)
    workdir: Path | None = None  # created before start; the process runs there

    @property
    def level(self) -> int:
        return LEVELS[self.role]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Topology:
    processes: tuple[ProcessSpec, ...]

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
    model: Path
    model_name: str | None = None
    prefill: int = 1
    decode: int = 1
    speculator: bool = True
    host: str = "127.0.0.1"
    gateway_port: int = 50051  # 0: a free port
    # Every other port (gRPC and metrics, gateway metrics included) is
    # base_port, base_port + 1, ... in process order; None: free ports.
    base_port: int | None = None
    redis_port: int | None = None  # None: from base_port, or free
    # Comma-separated devices, handed out to the workers round-robin:
    # "cuda:0,cuda:1" with --prefill 2 puts one worker on each.
    device_prefill: str = "cpu"
    device_decode: str = "cpu"
    log_level: str = "info"
    grace_seconds: float = 5.0  # each service's drain limit on SIGTERM
    python: str = sys.executable
    redis_server: str = "redis-server"
    # Extra KVMESH_* settings per role, e.g. {"decode": {"KVMESH_NUM_BLOCKS": "256"}}.
    role_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need at least one decode worker and no negative counts (prefill={self.prefill}, decode={self.decode})")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS may hand it out again later; good enough locally)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ports(options: MeshOptions, allocate: Callable[[], int]) -> Iterator[int]:
    if options.base_port is not None:
        yield from range(options.base_port, 65536)
        raise ValueError(f"--base-port {options.base_port} leaves too few ports")
    seen: set[int] = set()
    while True:
        port = allocate()
        if port not in seen and port not in (options.gateway_port, options.redis_port):  # the OS may repeat one
            seen.add(port)
            yield port


def _devices(spec: str) -> list[str]:
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError(f"no device in {spec!r}")
    return devices


def build_topology(options: MeshOptions, run_dir: Path, allocate_port: Callable[[], int] = free_port) -> Topology:
    """The mesh for ``options``; ``run_dir`` holds Redis's working directory (the supervisor adds logs)."""
    ports = _ports(options, allocate_port)
    host = options.host
    common = {
        "KVMESH_HOST": host,
        "KVMESH_LOG_LEVEL": options.log_level,
        "KVMESH_GRACE_SECONDS": f"{options.grace_seconds:g}",
        "PYTHONUNBUFFERED": "1",  # logs reach the log files as they are written
        # Several torch processes share these cores: OpenMP threads that spin-wait for each
        # other across processes make every parallel op orders of magnitude slower; sleeping
        # waiters cost a little wake-up latency instead.
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    specs: list[ProcessSpec] = []

    def service(name: str, role: str, env: dict[str, str], port: int | None = None, device: str | None = None) -> ProcessSpec:
        grpc_port = port if port is not None else next(ports)
        metrics_port = next(ports)
        full_env = {
            **common,
            "KVMESH_PORT": str(grpc_port),
            "KVMESH_METRICS_PORT": str(metrics_port),
            **env,
            **options.role_env.get(role, {}),
        }
        argv = (options.python, "-m", f"services.{role}.main")
        # Run from this checkout, so `-m services.<role>.main` is the launcher's own code.
        spec = ProcessSpec(name, role, argv, full_env, host, grpc_port, metrics_port, device, workdir=REPO_ROOT)
        specs.append(spec)
        return spec

    redis_port = options.redis_port if options.redis_port is not None else next(ports)
    redis = ProcessSpec(
        "redis",
        "redis",
        (options.redis_server, "--port", str(redis_port), "--bind", host, "--save", "", "--appendonly", "no", "--dir", "."),
        {},
        host,
        redis_port,
        health="redis",
        workdir=run_dir / "redis",
    )
    specs.append(redis)
    router = service("router", "router", {"KVMESH_REDIS_URL": f"redis://{host}:{redis_port}/0"})
    to_router = {"KVMESH_ROUTER_ADDRESS": router.address}
    kvstore = service("kvstore", "kvstore", {**to_router, "KVMESH_WORKER_ID": "kvstore"})
    speculator = service("speculator", "speculator", {}) if options.speculator else None

    model = {"KVMESH_MODEL": str(options.model)}
    worker_env = {**to_router, **model, "KVMESH_KVSTORE_ADDRESS": kvstore.address}
    for role, count, devices in (
        ("prefill", options.prefill, _devices(options.device_prefill)),
        ("decode", options.decode, _devices(options.device_decode)),
    ):
        for i in range(count):
            name, device = f"{role}-{i}", devices[i % len(devices)]
            env = {**worker_env, "KVMESH_WORKER_ID": name, "KVMESH_DEVICE": device}
            if role == "decode" and speculator is not None:
                env["KVMESH_SPECULATOR_ADDRESS"] = speculator.address
            service(name, role, env, device=device)

    gateway_port = options.gateway_port or next(ports)
    named = {"KVMESH_MODEL_NAME": options.model_name} if options.model_name else {}
    service("gateway", "gateway", {**to_router, **model, **named}, port=gateway_port)
    _check_distinct_ports(specs)
    return Topology(tuple(specs))


def _check_distinct_ports(specs: Sequence[ProcessSpec]) -> None:
    owners: dict[int, str] = {}
    for p in specs:
        for port in (p.port, p.metrics_port):
            if port is None:
                continue
            if port in owners:
                raise ValueError(f"port {port} is given to both {owners[port]} and {p.name}")
            owners[port] = p.name


def describe(topology: Topology, run_dir: Path) -> Sequence[str]:
    """The endpoints, one line per process, for people."""
    lines = []
    for p in topology.processes:
        where = f"redis://{p.address}/0" if p.health == "redis" else f"gRPC {p.address}"
        metrics = f"  metrics http://{p.host}:{p.metrics_port}/metrics" if p.metrics_port else ""
        device = f"  device {p.device}" if p.device else ""
        lines.append(f"  {p.name:<12} {where:<24}{metrics}{device}  log {run_dir / 'logs' / (p.name + '.log')}")
    return lines
