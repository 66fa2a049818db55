"""What a local mesh is made of, read from the compose file: every process, its command, environment, ports, device.

``compose/docker-compose.yml`` is the one description of the mesh; this turns
it into local processes, so ``kvmesh up`` and ``docker compose up`` cannot
drift apart:

- services: every service without a ``profiles`` entry (profiles are
  optional extras such as monitoring); ``redis`` runs the local
  ``redis-server``, every other service is ``python -m services.<command[0]>.main``
  with the rest of its ``command``, except ``certs`` (``kvmesh certs --out DIR``),
  which the launcher does itself before starting anything;
- mutual TLS: as the compose file sets it up (``KVMESH_TLS_*``, Redis's ACL file);
  ``MeshOptions.tls=False`` drops it all for a plaintext mesh;
- start order: ``depends_on`` (a service starts once everything it depends on
  is healthy); stop goes in reverse;
- environment: the service's ``environment``, with what only makes sense in a
  container rewritten: ``<service>:<port>`` addresses point at that process
  here (its host and local port), paths inside a mounted volume point at
  the bind source or at ``<run_dir>/volumes/<name>``, ``KVMESH_HOST`` is the
  process's host, and each worker's ``KVMESH_WORKER_ID`` is its process name;
- hosts: every process on ``MeshOptions.host`` (127.0.0.1), or each on the host
  ``MeshOptions.placement`` gives it (its address and network namespace:
  ``kvmesh.launcher.multihost``);
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

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.launcher.compose import REPO_ROOT, ComposeError, ComposeFile, ComposeService
from kvmesh.launcher.localize import (
    bind_root,
    check_distinct_ports,
    container_ports,
    local_addresses,
    local_path,
    mount_of,
    redis_port,
    redis_settings,
    start_levels,
)
from kvmesh.launcher.spec import (
    KVMESH_ROLES,
    PORT_SETTING,
    SCALED_ROLES,
    MeshOptions,
    ProcessSpec,
    Topology,
    local_gpu_count,
)
from kvmesh.runtime.certs import REDIS_PASSWORD_FILE, role_identity
from kvmesh.runtime.identity import PLAINTEXT_ROLES
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.tls import TlsFiles

# What only a mesh with mutual TLS sets; a plaintext mesh (MeshOptions.tls=False) drops them.
TLS_SETTINGS = ("KVMESH_TLS_CA", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_REDIS_PASSWORD_FILE")


def role_of(service: ComposeService) -> str | None:
    """``redis``, ``certs``, a kvmesh service name (``command: [<service>, ...]``), or None."""
    if service.command[:1] == ("redis-server",) or (service.image or "").split("/")[-1].startswith("redis"):
        return "redis"
    if service.command[:1] == ("certs",):
        return "certs"
    if service.command and service.command[0] in KVMESH_ROLES:
        return service.command[0]
    return None


def compose_model_path(options: MeshOptions) -> Path | None:
    """The host folder the compose file bind-mounts as the workers' ``KVMESH_MODEL`` (None: not a bind mount)."""
    compose = options.load_compose()
    for s in compose.services:
        if role_of(s) in SCALED_ROLES and "KVMESH_MODEL" in s.environment:
            found = mount_of(s.environment["KVMESH_MODEL"], s)
            if found is None or not found[0].bind:
                return None
            mount, rest = found
            return bind_root(mount, compose.path.parent) / rest
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
    host: str  # the address it binds to and is reached at
    netns: str | None  # its host's network namespace (None: the launcher's)
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
        self.certs: Path | None = None  # the certs service's folder, here

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
            if role == "certs":
                self._certs_service(s)
                continue
            count = self._count(s, role)
            for i in range(count):
                name = f"{s.name}-{i}" if role in SCALED_ROLES else s.name
                out.append(_Instance(s, role, name, i, *self._place(name)))
        if not any(i.role == "decode" for i in out):
            raise ComposeError(f"{self.compose.path}: no decode service")
        return out

    def _place(self, name: str) -> tuple[str, str | None]:
        placement = self.options.placement
        if placement is None:
            return self.options.host, None
        if name not in placement:
            raise ComposeError(f"process {name} is on none of the hosts (the hosts file places {', '.join(placement)})")
        return placement[name].address, placement[name].netns

    def _certs_service(self, service: ComposeService) -> None:
        args = service.command[1:]
        if len(args) != 2 or args[0] != "--out":
            raise ComposeError(f"service {service.name}: expected command [certs, --out, <dir in a volume>]")
        folder = local_path(args[1], service, self.compose.path.parent, self.run_dir)
        if folder is None:
            raise ComposeError(f"service {service.name}: {args[1]} is in none of its volumes")
        if self.options.tls:
            self.certs = Path(folder)

    def _tls_settings(self, env: dict[str, str]) -> None:
        """Keep the TLS settings only when this mesh makes its certificates (else drop them all)."""
        if self.certs is None:
            for key in TLS_SETTINGS:
                env.pop(key, None)

    def _health_identity(self, role: str, env: Mapping[str, str]) -> TlsFiles | None:
        if self.certs is None or role in PLAINTEXT_ROLES or "KVMESH_TLS_CA" not in env:
            return None
        return role_identity(self.certs, "operator")

    # -- ports -----------------------------------------------------------------

    def _fixed_ports(self, instances: Sequence[_Instance]) -> set[int]:
        fixed = {p for p in (self.options.gateway_port, self.options.redis_port) if p}
        for env in self.options.role_env.values():  # e.g. a KVMESH_HTTP_PORT the caller picked
            fixed |= {int(v) for k, v in env.items() if PORT_SETTING.fullmatch(k) and v.isdigit()}
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

    def _assign_ports(self, instances: Sequence[_Instance]) -> dict[str, tuple[str, dict[int, int]]]:
        """Give every instance its ports; returns service name -> its host and {container port: local port}
        (of its first replica)."""
        ports = self._port_source(instances)
        addresses: dict[str, tuple[str, dict[int, int]]] = {}
        for inst in instances:
            s = inst.service
            if inst.role == "redis":
                container = {"KVMESH_PORT": redis_port(s)}
                inst.ports["KVMESH_PORT"] = self.options.redis_port or next(ports)
            else:
                container = container_ports(s)
                for key, container_port in container.items():
                    inst.ports[key] = self._local_port(inst, key, container_port, ports)
            if inst.index == 0:  # a name with several replicas resolves to the first, as good as any
                addresses[s.name] = (inst.host, {container[k]: inst.ports[k] for k in container})
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
        gpus = inst.service.gpus  # what the container calls cuda:0, cuda:1, ...: a GPU per tensor-parallel rank
        name = inst.service.name
        for gpu in gpus:
            if not gpu.isdigit() or int(gpu) >= self._gpus_here():
                raise ComposeError(
                    f"service {name} is pinned to GPU {gpu}, but this machine has {self._gpus_here()} "
                    f"(GPU ids in compose/.env, or --device-{inst.role})"
                )
        first = int(gpus[0])
        if [int(g) for g in gpus] != list(range(first, first + len(gpus))):
            raise ComposeError(
                f"service {name} is pinned to GPUs {','.join(gpus)}: here a worker's ranks run on consecutive "
                "GPUs, rank r on the r-th from the first"
            )
        settings = {**inst.service.environment, **self.options.role_env.get(inst.role, {})}
        ranks = int(settings.get("KVMESH_TENSOR_PARALLEL_SIZE") or 1)
        if ranks > len(gpus):
            raise ComposeError(
                f"service {name} runs {ranks} tensor-parallel ranks, a GPU each, but is pinned to GPU "
                f"{','.join(gpus)}: pin one a rank (e.g. KVMESH_{inst.role.upper()}_GPU="
                f"{','.join(str(first + r) for r in range(ranks))} in compose/.env), or --device-{inst.role}"
            )
        return f"cuda:{first}"

    # -- the plan --------------------------------------------------------------

    def build(self) -> Topology:
        instances = self._instances()
        running = {i.service.name for i in instances}
        absent = {s.name for s in self.compose.services} - running
        levels = start_levels([i.service for i in instances], running)
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
        check_distinct_ports(specs)
        return Topology(tuple(specs), certs=self.certs)

    def _redis(self, inst: _Instance, level: int) -> ProcessSpec:
        o = self.options
        settings = redis_settings(inst.service.command[1:])
        settings |= {"port": [str(inst.port)], "bind": [inst.host], "dir": ["."]}
        if "aclfile" in settings:
            # In the certs volume: its local stand-in, or no password in a plaintext mesh.
            acl = local_path(settings["aclfile"][0], inst.service, self.compose.path.parent, self.run_dir)
            if self.certs is None or acl is None:
                del settings["aclfile"]
            else:
                settings["aclfile"] = [acl]
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
            inst.host,
            inst.port,
            netns=inst.netns,
            health="redis",
            workdir=self.run_dir / "redis",
            start_level=level,
            stop_grace_s=inst.service.stop_grace_s,
            redis_password_file=None if "aclfile" not in settings else self.certs / REDIS_PASSWORD_FILE,
        )

    def _service(
        self,
        inst: _Instance,
        level: int,
        device: str | None,
        addresses: Mapping[str, tuple[str, Mapping[int, int]]],
        absent: set[str],
    ) -> ProcessSpec:
        o, s = self.options, inst.service
        compose_dir = self.compose.path.parent
        env: dict[str, str] = {}
        for key, value in s.environment.items():
            if value == "":
                continue  # an empty variable counts as unset (kvmesh.runtime.flags)
            local = local_addresses(value, addresses, absent)
            if local is None:
                continue  # it points at a service that is not running here (e.g. --no-speculator)
            path = local_path(local, s, compose_dir, self.run_dir)
            env[key] = path if path is not None else local
        self._tls_settings(env)
        env |= {"KVMESH_HOST": inst.host, **{key: str(port) for key, port in inst.ports.items()}}
        if inst.role in SCALED_ROLES:
            env["KVMESH_WORKER_ID"] = inst.name
        if device is not None:
            env["KVMESH_DEVICE"] = device
        if o.model is not None and "KVMESH_MODEL" in env:
            env["KVMESH_MODEL"] = str(o.model)
            if o.hub_id is not None:
                env["KVMESH_MODEL"] = o.hub_id
                env["KVMESH_REVISION"] = o.commit or "main"
        if o.model_name and inst.role == "gateway":
            env["KVMESH_MODEL_NAME"] = o.model_name
        if o.log_level is not None:
            env["KVMESH_LOG_LEVEL"] = o.log_level
        if o.grace_seconds is not None:
            env["KVMESH_GRACE_SECONDS"] = f"{o.grace_seconds:g}"
        env |= o.role_env.get(inst.role, {})
        args = tuple(local_addresses(a, addresses, absent) for a in s.command[1:])
        if None in args:
            raise ComposeError(f"service {s.name}: its command names a service that is not running here: {s.command}")
        # Run from this checkout, so `-m services.<role>.main` is the launcher's own code.
        argv = (o.python, "-m", f"services.{inst.role}.main", *args)  # type: ignore[misc]
        return ProcessSpec(
            inst.name,
            inst.role,
            argv,
            env,
            inst.host,
            inst.port,
            inst.ports["KVMESH_METRICS_PORT"],
            device,
            netns=inst.netns,
            workdir=REPO_ROOT,
            start_level=level,
            stop_grace_s=s.stop_grace_s,
            health_identity=self._health_identity(inst.role, env),
        )
