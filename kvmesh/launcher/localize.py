"""Compose settings made local: what only makes sense in a container, rewritten for a process here.

Container ports become local ones, ``<service>:<port>`` addresses point at the local process, paths inside a
mounted volume point at the bind source or a run-folder stand-in, and start levels come from ``depends_on``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvmesh.launcher.compose import ComposeError, ComposeService, Mount
from kvmesh.launcher.spec import PORT_SETTING, REDIS_PORT, ProcessSpec


def container_ports(service: ComposeService) -> dict[str, int]:
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
        if PORT_SETTING.fullmatch(key) and raw.isdigit():
            out.setdefault(key, int(raw))
    return out


def redis_port(service: ComposeService) -> int:
    settings = redis_settings(service.command[1:])
    return int(settings["port"][0]) if "port" in settings else REDIS_PORT


def redis_settings(args: Sequence[str]) -> dict[str, list[str]]:
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


def local_addresses(value: str, addresses: Mapping[str, tuple[str, Mapping[int, int]]], absent: set[str]) -> str | None:
    """``value`` with every ``<service>:<container port>`` pointing at that service's process here
    (``addresses``: service -> its host and {container port: local port}); None when it names an ``absent`` service."""
    names_absent = False

    def local(m: re.Match[str]) -> str:
        nonlocal names_absent
        name, port = m.group(1), int(m.group(2))
        if name in addresses and port in addresses[name][1]:
            host, ports = addresses[name]
            return f"{host}:{ports[port]}"
        names_absent |= name in absent
        return m.group(0)

    out = re.sub(r"(?<![\w.-])([a-zA-Z][\w.-]*):(\d+)\b", local, value)
    return None if names_absent else out


def mount_of(value: str, service: ComposeService) -> tuple[Mount, str] | None:
    """The service's mount holding container path ``value``, and the path within it."""
    for mount in service.volumes:
        target = mount.target.rstrip("/")
        if value == target or value.startswith(target + "/"):
            return mount, value[len(target) :].lstrip("/")
    return None


def bind_root(mount: Mount, compose_dir: Path) -> Path:
    return (compose_dir / Path(mount.source or "").expanduser()).resolve()


def local_path(value: str, service: ComposeService, compose_dir: Path, run_dir: Path) -> str | None:
    """A container path inside one of the service's mounts, as the local path it stands for (None: not in a mount)."""
    found = mount_of(value, service)
    if found is None:
        return None
    mount, rest = found
    if mount.bind:
        root = bind_root(mount, compose_dir)
    else:
        root = run_dir / "volumes" / (mount.source or f"{service.name}{mount.target.replace('/', '-')}")
    return str(root / rest) if rest else str(root)


def start_levels(services: Sequence[ComposeService], running: set[str]) -> dict[str, int]:
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


def check_distinct_ports(specs: Sequence[ProcessSpec]) -> None:
    owners: dict[int, str] = {}
    for p in specs:
        listening = [int(v) for k, v in p.env.items() if PORT_SETTING.fullmatch(k) and v.isdigit()]
        for port in {p.port, p.metrics_port, *listening}:
            if port is None or port == 0:
                continue
            if port in owners:
                raise ValueError(f"port {port} is given to both {owners[port]} and {p.name}")
            owners[port] = p.name
