"""What a local mesh is made of, read from the compose file: every process, its command, environment, ports, device.

``compose/docker-compose.yml`` is the one description of the mesh; this turns
it into local processes, so ``kvmesh up`` and ``docker compose up`` cannot
drift apart:

- services: every service without a ``profiles`` entry (profiles are
  optional extras such as monitoring); ``redis`` runs the local
  ``redis-server``, every other service is ``python -m services.<command[0]>.main``
  with the rest of its ``command``;
- start order: ``depends_on`` (a service starts once everything it depends on
  is healthy); stop goes in reverse;
- environment: the service's ``environment``, with what only makes sense in a
  container rewritten: ``<service>:<port>`` addresses point at that process
  here (127.0.0.1 and its local port), paths inside a mounted volume point at
  the bind source or at ``<run_dir>/volumes/<name>``, ``KVMESH_HOST`` is the
  local host, and each worker's ``KVMESH_WORKER_ID`` is its process name;
- ports: each process needs its own, so every container port is remapped:
  published ones to their host port (the gateway's 50051), the rest to
  consecutive ports from ``base_port`` or free ones;
- replicas: ``deploy.replicas`` processes, named ``<service>-<i>``;
- devices: a GPU reservation ``device_ids: ["N"]`` becomes ``cuda:N`` here
  (the container sees that GPU as its cuda:0), or ``cpu`` without a GPU.

``MeshOptions`` is the override layer on top (the ``kvmesh up`` flags and the
Python API of the end-to-end tests and benchmarks): worker counts, devices,
ports, model, log level, grace period, extra settings per role.

Pure apart from reading the compose file: ``build_topology`` decides
everything up front (ports included), so the supervisor only starts what it is
given and tests can check the plan without starting anything.
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.launcher.compose import (
    COMPOSE_FILE,
    REPO_ROOT,
    ComposeError,
    ComposeFile,
    ComposeService,
    Mount,
    compose_variables,
    load_compose,
)

# Start levels of hand-built specs (tests, benchmarks); a compose plan takes its own from depends_on.
LEVELS = {"redis": 0, "router": 1, "kvstore": 2, "speculator": 2, "prefill": 3, "decode": 3, "gateway": 4}
KVMESH_ROLES = ("gateway", "router", "prefill", "decode", "kvstore", "speculator")
SCALED_ROLES = ("prefill", "decode")  # run as <service>-<i>, one worker id each
REDIS_PORT = 6379
_PORT_SETTING = re.compile(r"KVMESH_(\w+)_PORT")  # a port the service listens on (KVMESH_HTTP_PORT...)

__all__ = ["COMPOSE_FILE", "REPO_ROOT", "MeshOptions", "ProcessSpec", "Topology", "build_topology", "free_port"]


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
    start_level: int | None = None  # None: LEVELS[role]
    stop_grace_s: float | None = None  # SIGTERM to SIGKILL (None: the supervisor's default)

    @property
    def level(self) -> int:
        return LEVELS[self.role] if self.start_level is None else self.start_level

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
    """Overrides on top of the compose file; None everywhere means "as the compose file says"."""

    model: Path | None = None  # None: the compose file's model mount (its host folder)
    model_name: str | None = None
    prefill: int | None = None  # workers; None: the compose file's replicas (0: decode prefills)
    decode: int | None = None
    speculator: bool = True
    host: str = "127.0.0.1"
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS may hand it out again later; good enough locally)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_gpu_count() -> int:
    """GPUs NVML sees on this machine (0 without a driver)."""
    from kvmesh.runtime.gpu import gpu_stats

    return len(gpu_stats())


def role_of(service: ComposeService) -> str | None:
    """``redis``, a kvmesh service name (``command: [<service>, ...]``), or None."""
    if service.command[:1] == ("redis-server",) or (service.image or "").split("/")[-1].startswith("redis"):
        return "redis"
    if service.command and service.command[0] in KVMESH_ROLES:
        return service.command[0]
    return None


def compose_model_path(options: MeshOptions) -> Path | None:
    """The host folder the compose file bind-mounts as the workers' ``KVMESH_MODEL`` (None: not a bind mount)."""
    compose = options.load_compose()
    for s in compose.services:
        if role_of(s) in SCALED_ROLES and "KVMESH_MODEL" in s.environment:
            found = _mount_of(s.environment["KVMESH_MODEL"], s)
            if found is None or not found[0].bind:
                return None
            mount, rest = found
            return _bind_root(mount, compose.path.parent) / rest
    return None


def build_topology(
    options: MeshOptions,
    run_dir: Path,
    allocate_port: Callable[[], int] = free_port,
    *,
    gpu_count: int | None = None,
) -> Topology:
    """The mesh the compose file describes, with ``options`` on top; ``run_dir`` holds Redis's
    working directory and the local stand-ins for named volumes (the supervisor adds logs).
    ``gpu_count``: GPUs here (None: ask NVML)."""
    compose = options.load_compose()
    plan = _Plan(options, compose, run_dir, allocate_port, gpu_count)
    return plan.build()


@dataclass
class _Instance:
    service: ComposeService
    role: str
    name: str
    index: int  # replica number within the service
    # Local port per setting: {"KVMESH_PORT": 41001, "KVMESH_METRICS_PORT": 41002, "KVMESH_HTTP_PORT": 8000}
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.ports["KVMESH_PORT"]


class _Plan:
    def __init__(
        self,
        options: MeshOptions,
        compose: ComposeFile,
        run_dir: Path,
        allocate_port: Callable[[], int],
        gpu_count: int | None,
    ) -> None:
        self.options = options
        self.compose = compose
        self.run_dir = run_dir
        self.allocate_port = allocate_port
        self._gpu_count = gpu_count

    # -- which processes -------------------------------------------------------

    def _count(self, service: ComposeService, role: str) -> int:
        o = self.options
        if role == "speculator" and not o.speculator:
            return 0
        override = {"prefill": o.prefill, "decode": o.decode}.get(role)
        if override is not None:
            return override
        replicas = 1 if service.replicas is None else service.replicas
        if replicas != 1 and role not in SCALED_ROLES:
            raise ComposeError(
                f"service {service.name}: only {' and '.join(SCALED_ROLES)} run several replicas locally"
            )
        return replicas

    def _instances(self) -> list[_Instance]:
        out: list[_Instance] = []
        for s in self.compose.services:
            if s.profiles:
                continue  # optional extras (monitoring), not part of the mesh
            role = role_of(s)
            if role is None:
                raise ComposeError(
                    f"service {s.name}: kvmesh up runs redis and kvmesh services (command: [<service>, ...]); "
                    "give anything else a profile"
                )
            count = self._count(s, role)
            for i in range(count):
                name = f"{s.name}-{i}" if role in SCALED_ROLES else s.name
                out.append(_Instance(s, role, name, i))
        if not any(i.role == "decode" for i in out):
            raise ComposeError(f"{self.compose.path}: no decode service")
        return out

    # -- ports -----------------------------------------------------------------

    def _fixed_ports(self, instances: Sequence[_Instance]) -> set[int]:
        fixed = {p for p in (self.options.gateway_port, self.options.redis_port) if p}
        if self.options.publish:
            for inst in instances:
                fixed |= {m.host for m in inst.service.ports if m.host}
        return fixed

    def _port_source(self, instances: Sequence[_Instance]) -> Iterator[int]:
        base = self.options.base_port
        if base is not None:
            yield from range(base, 65536)
            raise ComposeError(f"--base-port {base} leaves too few ports")
        seen = self._fixed_ports(instances)
        while True:
            port = self.allocate_port()
            if port not in seen:  # the OS may repeat one
                seen.add(port)
                yield port

    def _local_port(self, inst: _Instance, key: str, container_port: int, ports: Iterator[int]) -> int:
        """A published container port keeps its host port (one replica only); the rest get ports of their own."""
        if key == "KVMESH_PORT" and inst.role == "gateway" and self.options.gateway_port is not None:
            return self.options.gateway_port or next(ports)
        host = next((m.host for m in inst.service.ports if m.container == container_port and m.host), None)
        if host is None or not self.options.publish:
            return next(ports)
        if inst.index > 0:
            raise ComposeError(f"service {inst.service.name}: several replicas cannot share host port {host}")
        return host

    def _assign_ports(self, instances: Sequence[_Instance]) -> dict[str, dict[int, int]]:
        """Give every instance its ports; returns service name -> {container port: local port} (first replica)."""
        ports = self._port_source(instances)
        addresses: dict[str, dict[int, int]] = {}
        for inst in instances:
            s = inst.service
            if inst.role == "redis":
                container = {"KVMESH_PORT": _redis_port(s)}
                inst.ports["KVMESH_PORT"] = self.options.redis_port or next(ports)
            else:
                container = _container_ports(s)
                for key, container_port in container.items():
                    inst.ports[key] = self._local_port(inst, key, container_port, ports)
            if inst.index == 0:  # a name with several replicas resolves to the first, as good as any
                addresses[s.name] = {container[k]: inst.ports[k] for k in container}
        return addresses

    # -- devices ---------------------------------------------------------------

    def _gpus_here(self) -> int:
        if self._gpu_count is None:
            self._gpu_count = local_gpu_count()
        return self._gpu_count

    def _device(self, inst: _Instance, role_index: int) -> str | None:
        override = {"prefill": self.options.device_prefill, "decode": self.options.device_decode}.get(inst.role)
        if override is not None:
            devices = [d.strip() for d in override.split(",") if d.strip()]
            if not devices:
                raise ComposeError(f"no device in {override!r}")
            return devices[role_index % len(devices)]
        if not inst.service.gpus:
            return inst.service.environment.get("KVMESH_DEVICE")
        if self._gpus_here() == 0:
            return "cpu"
        gpu = inst.service.gpus[0]  # what the container calls cuda:0
        if not gpu.isdigit() or int(gpu) >= self._gpus_here():
            raise ComposeError(
                f"service {inst.service.name} is pinned to GPU {gpu}, but this machine has {self._gpus_here()} "
                f"(GPU ids in compose/.env, or --device-{inst.role})"
            )
        return f"cuda:{gpu}"

    # -- the plan --------------------------------------------------------------

    def build(self) -> Topology:
        instances = self._instances()
        running = {i.service.name for i in instances}
        absent = {s.name for s in self.compose.services} - running
        levels = _start_levels([i.service for i in instances], running)
        addresses = self._assign_ports(instances)
        specs: list[ProcessSpec] = []
        per_role: dict[str, int] = {}
        for inst in instances:
            role_index = per_role.get(inst.role, 0)
            per_role[inst.role] = role_index + 1
            level = levels[inst.service.name]
            if inst.role == "redis":
                specs.append(self._redis(inst, level))
            else:
                specs.append(self._service(inst, level, self._device(inst, role_index), addresses, absent))
        _check_distinct_ports(specs)
        return Topology(tuple(specs))

    def _redis(self, inst: _Instance, level: int) -> ProcessSpec:
        o = self.options
        settings = _redis_settings(inst.service.command[1:])
        settings |= {"port": [str(inst.port)], "bind": [o.host], "dir": ["."]}
        if not o.redis_persistence:
            settings |= {"save": [""], "appendonly": ["no"]}
        argv = [o.redis_server]
        for key, values in settings.items():
            argv += [f"--{key}", *values]
        return ProcessSpec(
            inst.name,
            "redis",
            tuple(argv),
            {},
            o.host,
            inst.port,
            health="redis",
            workdir=self.run_dir / "redis",
            start_level=level,
            stop_grace_s=inst.service.stop_grace_s,
        )

    def _service(
        self,
        inst: _Instance,
        level: int,
        device: str | None,
        addresses: Mapping[str, Mapping[int, int]],
        absent: set[str],
    ) -> ProcessSpec:
        o, s = self.options, inst.service
        compose_dir = self.compose.path.parent
        env: dict[str, str] = {}
        for key, value in s.environment.items():
            if value == "":
                continue  # an empty variable counts as unset (kvmesh.runtime.flags)
            local = _local_addresses(value, addresses, absent, o.host)
            if local is None:
                continue  # it points at a service that is not running here (e.g. --no-speculator)
            path = _local_path(local, s, compose_dir, self.run_dir)
            env[key] = path if path is not None else local
        env |= {"KVMESH_HOST": o.host, **{key: str(port) for key, port in inst.ports.items()}}
        if inst.role in SCALED_ROLES:
            env["KVMESH_WORKER_ID"] = inst.name
        if device is not None:
            env["KVMESH_DEVICE"] = device
        if o.model is not None and "KVMESH_MODEL" in env:
            env["KVMESH_MODEL"] = str(o.model)
        if o.model_name and inst.role == "gateway":
            env["KVMESH_MODEL_NAME"] = o.model_name
        if o.log_level is not None:
            env["KVMESH_LOG_LEVEL"] = o.log_level
        if o.grace_seconds is not None:
            env["KVMESH_GRACE_SECONDS"] = f"{o.grace_seconds:g}"
        env |= o.role_env.get(inst.role, {})
        args = tuple(_local_addresses(a, addresses, absent, o.host) for a in s.command[1:])
        if None in args:
            raise ComposeError(f"service {s.name}: its command names a service that is not running here: {s.command}")
        # Run from this checkout, so `-m services.<role>.main` is the launcher's own code.
        argv = (o.python, "-m", f"services.{inst.role}.main", *args)  # type: ignore[misc]
        return ProcessSpec(
            inst.name,
            inst.role,
            argv,
            env,
            o.host,
            inst.port,
            inst.ports["KVMESH_METRICS_PORT"],
            device,
            workdir=REPO_ROOT,
            start_level=level,
            stop_grace_s=s.stop_grace_s,
        )


def _container_ports(service: ComposeService) -> dict[str, int]:
    """The service's ports inside its container: KVMESH_PORT, KVMESH_METRICS_PORT and any other KVMESH_*_PORT."""
    out = {}
    for key in ("KVMESH_PORT", "KVMESH_METRICS_PORT"):
        raw = service.environment.get(key, "")
        if not raw.isdigit():
            raise ComposeError(
                f"service {service.name}: set {key} in its environment, so its address can be mapped here"
            )
        out[key] = int(raw)
    for key, raw in service.environment.items():
        if _PORT_SETTING.fullmatch(key) and raw.isdigit():
            out.setdefault(key, int(raw))
    return out


def _redis_port(service: ComposeService) -> int:
    settings = _redis_settings(service.command[1:])
    return int(settings["port"][0]) if "port" in settings else REDIS_PORT


def _redis_settings(args: Sequence[str]) -> dict[str, list[str]]:
    """``--name value...`` pairs of a redis-server command line, in order."""
    settings: dict[str, list[str]] = {}
    key = None
    for a in args:
        if a.startswith("--"):
            key = a[2:]
            settings[key] = []
        elif key is None:
            raise ComposeError(f"redis command: expected --option before {a!r} (a config file is not supported)")
        else:
            settings[key].append(a)
    return settings


def _local_addresses(value: str, addresses: Mapping[str, Mapping[int, int]], absent: set[str], host: str) -> str | None:
    """``value`` with every ``<service>:<container port>`` pointing here; None when it names an ``absent`` service."""
    names_absent = False

    def local(m: re.Match[str]) -> str:
        nonlocal names_absent
        name, port = m.group(1), int(m.group(2))
        if name in addresses and port in addresses[name]:
            return f"{host}:{addresses[name][port]}"
        names_absent |= name in absent
        return m.group(0)

    out = re.sub(r"(?<![\w.-])([a-zA-Z][\w.-]*):(\d+)\b", local, value)
    return None if names_absent else out


def _mount_of(value: str, service: ComposeService) -> tuple[Mount, str] | None:
    """The service's mount holding container path ``value``, and the path within it."""
    for mount in service.volumes:
        target = mount.target.rstrip("/")
        if value == target or value.startswith(target + "/"):
            return mount, value[len(target) :].lstrip("/")
    return None


def _bind_root(mount: Mount, compose_dir: Path) -> Path:
    return (compose_dir / Path(mount.source or "").expanduser()).resolve()


def _local_path(value: str, service: ComposeService, compose_dir: Path, run_dir: Path) -> str | None:
    """A container path inside one of the service's mounts, as the local path it stands for (None: not in a mount)."""
    found = _mount_of(value, service)
    if found is None:
        return None
    mount, rest = found
    if mount.bind:
        root = _bind_root(mount, compose_dir)
    else:
        root = run_dir / "volumes" / (mount.source or f"{service.name}{mount.target.replace('/', '-')}")
    return str(root / rest) if rest else str(root)


def _start_levels(services: Sequence[ComposeService], running: set[str]) -> dict[str, int]:
    """depends_on as start levels: 0 without dependencies, else one above the highest dependency."""
    by_name = {s.name: s for s in services}
    levels: dict[str, int] = {}

    def level(name: str, path: tuple[str, ...]) -> int:
        if name in path:
            raise ComposeError(f"depends_on cycle: {' -> '.join((*path, name))}")
        if name not in levels:
            deps = [d for d in by_name[name].depends_on if d in running]
            levels[name] = 1 + max((level(d, (*path, name)) for d in deps), default=-1)
        return levels[name]

    for s in services:
        level(s.name, ())
    return levels


def _check_distinct_ports(specs: Sequence[ProcessSpec]) -> None:
    owners: dict[int, str] = {}
    for p in specs:
        listening = [int(v) for k, v in p.env.items() if _PORT_SETTING.fullmatch(k) and v.isdigit()]
        for port in {p.port, p.metrics_port, *listening}:
            if port is None or port == 0:
                continue
            if port in owners:
                raise ValueError(f"port {port} is given to both {owners[port]} and {p.name}")
            owners[port] = p.name


def describe(topology: Topology, run_dir: Path) -> Sequence[str]:
    """The endpoints, one line per process, for people."""
    lines = []
    for p in topology.processes:
        where = f"redis://{p.address}/0" if p.health == "redis" else f"gRPC {p.address}"
        others = "".join(
            f"  {m.group(1).lower()} {p.host}:{v}"
            for k, v in p.env.items()
            if (m := _PORT_SETTING.fullmatch(k)) and m.group(1) != "METRICS"
        )
        metrics = f"  metrics http://{p.host}:{p.metrics_port}/metrics" if p.metrics_port else ""
        device = f"  device {p.device}" if p.device else ""
        lines.append(f"  {p.name:<12} {where:<24}{others}{metrics}{device}  log {run_dir / 'logs' / (p.name + '.log')}")
    return lines
