"""``kvmesh health``: ask a service's gRPC health endpoint (grpc.health.v1) whether it is SERVING.

The container health check of every kvmesh service (compose/Dockerfile,
compose/docker-compose.yml): with no ``--address`` it checks the service in
its own container, ``127.0.0.1:$KVMESH_PORT``. Exit 0: SERVING; 1: anything
else (NOT_SERVING while loading or draining, unreachable, unknown service
name); 2: nothing to check. With the service's mutual TLS settings (``--tls-*``
or its own ``KVMESH_TLS_*``) it asks as that service; a service whose
certificate names a plaintext role (the gateway) is asked in plaintext.
``kvmesh/cli.py`` wires it in with ``add_health_parser(subparsers)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.runtime.advertise import WILDCARDS
from kvmesh.runtime.channel import create_blocking_channel
from kvmesh.runtime.flags import TLS_FLAGS
from kvmesh.runtime.identity import PLAINTEXT_ROLES, certificate_role
from kvmesh.runtime.tls import TlsFiles


def add_health_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "health", help="exit 0 when a service's gRPC health says SERVING (the container health check)"
    )
    p.add_argument(
        "--address", help="host:port (default: this host's own service, KVMESH_HOST or 127.0.0.1 : KVMESH_PORT)"
    )
    p.add_argument(
        "--service",
        default="",
        help="a gRPC service name, e.g. kvmesh.api.router.v1.RouterService (default: the whole server)",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    for f in TLS_FLAGS:  # the service's own settings, so the container's health check asks as it
        p.add_argument(f.name, default=os.environ.get(f.env_var) or None, help=f"{f.help} (default: ${f.env_var})")
    p.set_defaults(func=run_health)
    return p


def default_address(environ: Mapping[str, str]) -> str | None:
    """This host's own service: KVMESH_HOST (127.0.0.1 when it binds every interface) and KVMESH_PORT."""
    port = environ.get("KVMESH_PORT", "")
    if not port:
        return None
    host = environ.get("KVMESH_HOST", "")
    host = "127.0.0.1" if host in WILDCARDS else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def health_identity(args: argparse.Namespace) -> TlsFiles | None:
    """How to ask: as the given certificate, or in plaintext (none, or a role that serves in plaintext)."""
    identity = TlsFiles.from_args(args)
    if identity is None or certificate_role(identity.cert.read_bytes()) in PLAINTEXT_ROLES:
        return None
    return identity


def check_health(
    address: str, service: str = "", timeout_s: float = 3.0, identity: TlsFiles | None = None
) -> tuple[bool, str]:
    """(SERVING?, what was seen, for people)."""
    with create_blocking_channel(address, identity) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def run_health(args: argparse.Namespace) -> int:
    address = args.address or default_address(os.environ)
    if address is None:
        print("kvmesh health: give --address host:port or set KVMESH_PORT", file=sys.stderr)
        return 2
    serving, seen = check_health(address, args.service, args.timeout, health_identity(args))
    what = f"{address}" + (f" {args.service}" if args.service else "")
    print(f"{what}: {seen}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1
