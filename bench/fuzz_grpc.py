"""Fuzz every internal gRPC API of a real mesh for a while: calls per service, statuses seen, and what broke.

Starts a mesh of real processes (tests.e2e.mesh_helpers: the tiny test model, one worker of each kind, short
lease TTLs), then round after round calls every method of every service with messages drawn from its
request descriptor and with bytes that are no message (tests.fuzz), a new seed each round, until
``--minutes`` have passed. After each service's batch: every process alive and SERVING, nothing left in
flight, no block or lease held, and a normal request through the gateway answered with its greedy tokens.
The anchor is the rule itself: 0 INTERNAL/UNKNOWN, 0 hangs, 0 crashes, 0 leaks.

    python bench/fuzz_grpc.py --minutes 10 [--examples 20] [--json bench/results/fuzz_grpc.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402

from tests.e2e.mesh_helpers import start_mesh, write_model  # noqa: E402
from tests.e2e.test_fuzz_grpc import LEASE_TTL_MS, normal_request  # noqa: E402
from tests.fuzz.harness import SERVICES, Fuzzer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--examples", type=int, default=20, help="calls of each method per round")
    ap.add_argument("--json", default="bench/results/fuzz_grpc.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "llama")
        mesh = start_mesh(
            model,
            Path(tmp) / "mesh",
            role_env={
                "prefill": {"KVMESH_LEASE_TTL_MS": str(LEASE_TTL_MS), "KVMESH_MAX_LEASE_TTL_MS": str(2 * LEASE_TTL_MS)},
                "decode": {"KVMESH_NUM_SPECULATIVE_TOKENS": "3"},
            },
        )
        fuzzer = Fuzzer(mesh)
        checks, failures, rounds = 0, [], 0
        started = time.monotonic()
        try:
            while time.monotonic() - started < args.minutes * 60:
                rounds += 1
                for service, (process, _) in sorted(SERVICES.items()):
                    for proc, svc, method in fuzzer.methods():
                        if proc == process:
                            fuzzer.fuzz(proc, svc, method, args.examples, at=rounds * 1_000_003 + len(method.name))
                    try:
                        fuzzer.check_mesh(lambda: normal_request(mesh, model), settle_s=3 * LEASE_TTL_MS / 1000)
                    except AssertionError as e:
                        failures.append(f"round {rounds}, after {service}: {e}")
                    checks += 1
                print(f"round {rounds}: {fuzzer.tally.calls} calls, {len(fuzzer.tally.broken)} broken", flush=True)
        finally:
            crashed = mesh.crashed()
            mesh.stop()

    per_service: Counter[str] = Counter()
    codes: dict[str, Counter[str]] = {}
    for (where, code), n in fuzzer.tally.statuses.items():
        service = where.split("/")[0]
        per_service[service] += n
        codes.setdefault(service, Counter())[code] += n
    rows = [[s, per_service[s], ", ".join(f"{c} {n}" for c, n in codes[s].most_common())] for s in sorted(codes)]
    print_table(["service", "calls", "statuses"], rows)
    internal = sum(n for (_, c), n in fuzzer.tally.statuses.items() if c in ("INTERNAL", "UNKNOWN"))
    hangs = sum(n for (_, c), n in fuzzer.tally.statuses.items() if c == "DEADLINE_EXCEEDED")
    summary = {
        "minutes": round((time.monotonic() - started) / 60, 2),
        "rounds": rounds,
        "calls": fuzzer.tally.calls,
        "internal_or_unknown": internal,
        "hangs": hangs,
        "crashed": crashed,
        "mesh_checks": checks,
        "failed_checks": failures,
        "broken_calls": fuzzer.tally.broken[:50],
        "statuses": {f"{w} {c}": n for (w, c), n in sorted(fuzzer.tally.statuses.items())},
    }
    print(
        f"{summary['calls']} calls in {rounds} rounds: {internal} INTERNAL/UNKNOWN, {hangs} hangs, "
        f"{len(crashed)} crashed, {len(failures)} of {checks} mesh checks failed (leaks, health, a normal request)"
    )
    write_json(args.json, summary)
    return 0 if not (internal or hangs or crashed or failures) else 1


if __name__ == "__main__":
    sys.exit(main())
