"""Write deploy/helm/kvmesh/files/callers.json: per service, the roles that may call any of its methods
(kvmesh/runtime/authz.py's table folded per service). The chart renders its NetworkPolicies from it and
deploy/helm/validate checks them against it. ``--check``: fail when the file is stale."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvmesh.generated import write_or_check
from kvmesh.runtime.authz import CALLERS, PUBLIC

OUT = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "kvmesh" / "files" / "callers.json"


def edges() -> dict[str, list[str] | str]:
    """{"router": ["decode", "gateway", ...], "gateway": "*", ...}; "operator" is a person, not a pod."""
    out: dict[str, list[str] | str] = {}
    for service, rule in CALLERS.items():
        component = service.split(".")[2]  # kvmesh.api.<component>.v1.<Name>
        if rule == PUBLIC:
            out[component] = PUBLIC
        else:
            out[component] = sorted({r for roles in rule.values() for r in roles} - {"operator"})
    return dict(sorted(out.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = json.dumps(edges(), indent=2) + "\n"
    return write_or_check(OUT, text, check=args.check, regenerate="python scripts/authz_edges.py")


if __name__ == "__main__":
    sys.exit(main())
