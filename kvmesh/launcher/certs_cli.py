"""``kvmesh certs``: make the mesh's CA and role certificates in a folder (compose's ``certs`` service), or
renew one role's. ``kvmesh/cli.py`` wires it in with ``add_certs_parser(subparsers)``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.runtime.certs import ensure_mesh_certs, renew
from kvmesh.runtime.identity import ROLES


def add_certs_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "certs",
        help="make the mesh's CA and a certificate per role for mutual TLS (kept when already there)",
    )
    p.add_argument("--out", type=Path, required=True, help="the folder (a volume shared with the services)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="another DNS name or IP every certificate is valid for (repeatable)",
    )
    p.add_argument("--renew", choices=ROLES, action="append", default=[], help="issue this role a new certificate")
    p.set_defaults(func=run_certs)
    return p


def run_certs(args: argparse.Namespace) -> int:
    ensure_mesh_certs(args.out, hosts=args.host)
    for role in args.renew:
        renew(args.out, role, hosts=args.host)
    print(f"mesh certificates in {args.out} (roles: {', '.join(ROLES)})")
    return 0
