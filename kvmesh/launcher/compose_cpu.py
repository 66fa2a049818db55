"""Write ``compose/docker-compose.cpu.yml``: the same topology as ``docker-compose.yml``, without GPUs.

Compose has no portable way to *remove* a key in an override file (an
override's ``devices: []`` is merged into the GPU reservation, not put in its
place; the ``!reset`` tag of recent Compose v2 is unknown to Debian's
docker-compose 1.29 and older v2), so the CPU variant is a complete file
generated from the GPU one: every GPU reservation dropped, ``KVMESH_DEVICE``
set to ``cpu``, and the image and build args taken from the main file's
``x-cpu-variant``. ``${...}`` references are kept as written; YAML anchors come
out expanded. A test fails when the committed file is stale.

    python -m kvmesh.launcher.compose_cpu            # rewrite it
    python -m kvmesh.launcher.compose_cpu --check    # exit 1 when stale
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from kvmesh.generated import write_or_check
from kvmesh.launcher.compose import COMPOSE_FILE, ComposeError, load_raw

CPU_COMPOSE_FILE = COMPOSE_FILE.with_name("docker-compose.cpu.yml")

HEADER = """\
# GENERATED from docker-compose.yml by `python -m kvmesh.launcher.compose_cpu`: edit that file, then rerun.
#
# kvmesh without GPUs: the same services, settings and start order as
# docker-compose.yml, every worker on the CPU, the slim CPU image.
#
#   docker compose -f compose/docker-compose.cpu.yml up -d
#   docker compose -f compose/docker-compose.cpu.yml --profile monitoring up -d
#
# A complete file rather than an override: an override cannot delete the GPU
# reservations portably (see kvmesh/launcher/compose_cpu.py).
"""


class _NoAliases(yaml.SafeDumper):
    """Anchors expanded (the loaded tree shares the anchored objects; a dump would re-alias them)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def cpu_variant(raw: dict[str, Any]) -> dict[str, Any]:
    """The CPU file's tree from the GPU file's (as written, anchors resolved)."""
    variant = raw.get("x-cpu-variant")
    if not isinstance(variant, dict) or "image" not in variant:
        raise ComposeError("docker-compose.yml: x-cpu-variant (image, build-args) is missing")
    out = {k: copy.deepcopy(v) for k, v in raw.items() if not str(k).startswith("x-")}
    for service in out["services"].values():
        build = service.get("build")
        if isinstance(build, dict) and str(build.get("dockerfile", "")).endswith("compose/Dockerfile"):
            service["image"] = variant["image"]
            build["args"] = {**build.get("args", {}), **variant.get("build-args", {})}
        _drop_gpus(service)
        env = service.get("environment")
        if isinstance(env, dict) and "KVMESH_DEVICE" in env:
            env["KVMESH_DEVICE"] = "cpu"
    return out


def _drop_gpus(service: dict[str, Any]) -> None:
    deploy = service.get("deploy") or {}
    reservations = (deploy.get("resources") or {}).get("reservations") or {}
    devices = [d for d in reservations.get("devices") or () if "gpu" not in (d.get("capabilities") or ())]
    if devices:
        reservations["devices"] = devices
        return
    reservations.pop("devices", None)
    # Leave no empty mappings behind.
    for parent, key in ((deploy.get("resources") or {}, "reservations"), (deploy, "resources")):
        if parent.get(key) == {}:
            parent.pop(key)
    if "deploy" in service and service["deploy"] == {}:
        service.pop("deploy")


def render(compose_file: Path = COMPOSE_FILE) -> str:
    tree = cpu_variant(load_raw(compose_file))
    return HEADER + "\n" + yaml.dump(tree, Dumper=_NoAliases, sort_keys=False, width=120, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.launcher.compose_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file differs")
    args = parser.parse_args(argv)
    return write_or_check(
        CPU_COMPOSE_FILE, render(), check=args.check, regenerate="python -m kvmesh.launcher.compose_cpu"
    )


if __name__ == "__main__":
    sys.exit(main())
