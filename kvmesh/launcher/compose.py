"""Reading a compose file the way Compose does: ``${VAR}`` from ``.env`` and the environment, then a typed view.

``kvmesh up`` plans its processes from ``compose/docker-compose.yml`` (see
``topology.py``), so this reads only what that plan needs: each service's
command, environment, ports, volumes, GPU reservations, replicas,
``depends_on``, profiles and stop grace period. Interpolation follows the
Compose spec's subset that every implementation (Debian's docker-compose 1.29
included) understands: ``$VAR``, ``${VAR}``, ``${VAR:-default}``,
``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}`` and ``$$`` for a
literal ``$``; values are interpolated, keys are not.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "compose" / "docker-compose.yml"

_REFERENCE = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[_a-zA-Z][_a-zA-Z0-9]*))")
_BRACED = re.compile(r"(?P<name>[_a-zA-Z][_a-zA-Z0-9]*)(?:(?P<op>:?[-?])(?P<arg>.*))?", re.DOTALL)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ComposeError(ValueError):
    """The compose file cannot be read, or asks for something ``kvmesh up`` cannot do locally."""


@dataclass(frozen=True)
class PortMapping:
    container: int
    host: int | None  # None: not published


@dataclass(frozen=True)
class Mount:
    target: str  # the path inside the container
    source: str | None  # a named volume or a host path (None: an anonymous volume)
    bind: bool  # True: ``source`` is a host path (relative to the compose file's folder)
    read_only: bool = False


@dataclass(frozen=True)
class ComposeService:
    name: str
    command: tuple[str, ...]
    environment: Mapping[str, str]
    image: str | None = None
    ports: tuple[PortMapping, ...] = ()
    expose: tuple[int, ...] = ()
    volumes: tuple[Mount, ...] = ()
    gpus: tuple[str, ...] = ()  # device_ids of the GPU reservations, in order
    depends_on: Mapping[str, str] = field(default_factory=dict)  # service -> condition
    replicas: int | None = None  # None: no deploy.replicas (a single container)
    profiles: tuple[str, ...] = ()
    stop_grace_s: float | None = None
    healthcheck: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ComposeFile:
    path: Path
    services: tuple[ComposeService, ...]  # in file order

    def service(self, name: str) -> ComposeService:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(name)


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, ``export``, quotes), as Compose reads ``.env``; {} when absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").lstrip()
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[_a-zA-Z][_a-zA-Z0-9]*", key.strip()):
            raise ComposeError(f"{path}:{number}: expected KEY=VALUE, got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        else:
            value = re.sub(r"\s+#.*$", "", value)  # an unquoted value ends at an inline comment
        out[key.strip()] = value
    return out


def compose_variables(
    compose_file: Path = COMPOSE_FILE, env_file: Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What ``${VAR}`` sees: ``env_file`` (default: ``.env`` beside the compose file), then the environment,
    which wins."""
    env_file = env_file if env_file is not None else compose_file.parent / ".env"
    return {**read_env_file(env_file), **(os.environ if environ is None else environ)}


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    def substitute(m: re.Match[str]) -> str:
        if m.group("dollar"):
            return "$"
        if m.group("named"):
            return variables.get(m.group("named"), "")
        braced = _BRACED.fullmatch(m.group("braced"))
        if braced is None:
            raise ComposeError(f"invalid interpolation {m.group(0)!r} in {text!r}")
        name, op, arg = braced.group("name", "op", "arg")
        value = variables.get(name)
        missing = value is None or (value == "" and op is not None and op.startswith(":"))
        if op is None:
            return value or ""
        if op.endswith("-"):
            return interpolate(arg, variables) if missing else value  # type: ignore[return-value]
        if missing:
            raise ComposeError(f"{name} is required: {arg or 'set it in .env or the environment'}")
        return value  # type: ignore[return-value]

    return _REFERENCE.sub(substitute, text)


def _interpolate_tree(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, variables) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(v, variables) for v in node]
    return node


def load_raw(path: Path) -> dict[str, Any]:
    """The YAML as written (anchors and merge keys resolved, ``${...}`` left alone)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ComposeError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    return data


def load_compose(path: Path = COMPOSE_FILE, variables: Mapping[str, str] | None = None) -> ComposeFile:
    """Parse and interpolate ``path``; ``variables`` default to :func:`compose_variables`."""
    variables = compose_variables(path) if variables is None else variables
    data = _interpolate_tree(load_raw(path), variables)
    services = []
    for name, raw in data["services"].items():
        try:
            services.append(_service(name, raw or {}))
        except (TypeError, ValueError, AttributeError) as e:
            raise ComposeError(f"{path}: service {name}: {e}") from e
    return ComposeFile(path, tuple(services))


def _service(name: str, raw: Mapping[str, Any]) -> ComposeService:
    deploy = raw.get("deploy") or {}
    replicas = deploy.get("replicas")
    return ComposeService(
        name=name,
        command=_command(raw.get("command")),
        environment=_environment(raw.get("environment")),
        image=raw.get("image"),
        ports=tuple(_port(p) for p in raw.get("ports") or ()),
        expose=tuple(int(str(p).split("/")[0]) for p in raw.get("expose") or ()),
        volumes=tuple(_mount(v) for v in raw.get("volumes") or ()),
        gpus=_gpus(deploy),
        depends_on=_depends_on(raw.get("depends_on")),
        replicas=None if replicas is None else int(replicas),
        profiles=tuple(raw.get("profiles") or ()),
        stop_grace_s=None if raw.get("stop_grace_period") is None else parse_duration(str(raw["stop_grace_period"])),
        healthcheck=raw.get("healthcheck"),
    )


def _command(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return tuple(raw.split())
    return tuple(str(a) for a in raw)


def _environment(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, list):  # ["KEY=VALUE", "KEY"] (a bare KEY passes the host's value through)
        pairs = [item.partition("=") for item in raw]
        return {k: v for k, sep, v in pairs if sep}
    return {k: _scalar(v) for k, v in raw.items() if v is not None}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _port(raw: Any) -> PortMapping:
    if isinstance(raw, dict):
        published = raw.get("published")
        return PortMapping(int(raw["target"]), None if published in (None, "") else int(published))
    parts = str(raw).split("/")[0].split(":")
    if any("-" in p for p in parts[-2:]):
        raise ValueError(f"port ranges are not supported: {raw!r}")
    if len(parts) == 1:
        return PortMapping(int(parts[0]), None)
    host = parts[-2]
    return PortMapping(int(parts[-1]), int(host) if host else None)


def _mount(raw: Any) -> Mount:
    if isinstance(raw, dict):
        kind = raw.get("type", "volume")
        return Mount(raw["target"], raw.get("source"), kind == "bind", bool(raw.get("read_only", False)))
    parts = str(raw).split(":")
    if len(parts) == 1:
        return Mount(parts[0], None, False)
    source, target = parts[0], parts[1]
    read_only = len(parts) > 2 and "ro" in parts[2].split(",")
    bind = source.startswith((".", "/", "~"))
    return Mount(target, source, bind, read_only)


def _gpus(deploy: Mapping[str, Any]) -> tuple[str, ...]:
    devices = ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or ()
    ids: list[str] = []
    for d in devices:
        if "gpu" in (d.get("capabilities") or ()):
            # "0,1" in one entry (a variable's value: compose cannot interpolate a list) is two GPUs.
            ids += [part.strip() for i in d.get("device_ids") or () for part in str(i).split(",")]
    return tuple(ids)


def _depends_on(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, list):
        return {name: "service_started" for name in raw}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in raw.items()}


def parse_duration(text: str) -> float:
    """Compose durations (``30s``, ``1m30s``, ``500ms``; a bare number is seconds) in seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
