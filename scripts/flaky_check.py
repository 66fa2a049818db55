"""Run a set of tests several times in a row and report every test whose outcome changed between runs.

    python3 scripts/flaky_check.py --runs 3 tests/e2e tests/openai tests/clients

``make flaky-check`` runs the end-to-end set (real processes) this way. Each run writes the durations
JSON (tests/durations.py), whose outcomes are compared; the exit status is 1 when any test changed
outcome or failed in every run, 0 when all runs agree and passed. The table goes to stdout and, with
``--json``, every run's outcomes to a file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(paths: list[str], pytest_args: list[str], out: Path) -> dict[str, str]:
    argv = [sys.executable, "-m", "pytest", "-q", *pytest_args, f"--durations-json={out}", *paths]
    subprocess.run(argv, cwd=REPO, check=False)
    return {t["nodeid"]: t["outcome"] for t in json.loads(out.read_text())["tests"]}


def changed(runs: list[dict[str, str]]) -> dict[str, list[str]]:
    """Tests whose outcome differs between runs (a test missing from a run counts as 'absent')."""
    names = sorted(set().union(*runs))
    table = {n: [r.get(n, "absent") for r in runs] for n in names}
    return {n: outcomes for n, outcomes in table.items() if len(set(outcomes)) > 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="test folders or files")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pytest-args", default="-n 2 --dist loadgroup", help="passed to every run")
    parser.add_argument("--json", type=Path, help="write every run's outcomes here")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            print(f"flaky-check: run {i + 1} of {args.runs}", flush=True)
            runs.append(run_once(args.paths, args.pytest_args.split(), Path(tmp) / f"run{i}.json"))
    flaky = changed(runs)
    always_failed = sorted(n for n in set().union(*runs) if all(r.get(n) == "failed" for r in runs))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "changed": flaky, "always_failed": always_failed}, indent=1))
    print(f"\nflaky-check: {args.runs} runs of {len(set().union(*runs))} tests")
    print("| test | " + " | ".join(f"run {i + 1}" for i in range(args.runs)) + " |")
    print("|---|" + "---|" * args.runs)
    for name, outcomes in flaky.items():
        print(f"| `{name}` | " + " | ".join(outcomes) + " |")
    for name in always_failed:
        print(f"| `{name}` | " + " | ".join(["failed"] * args.runs) + " |")
    verdict = "identical outcomes, all passed" if not flaky and not always_failed else "NOT identical or failing"
    print(f"flaky-check: {verdict} ({len(flaky)} changed, {len(always_failed)} failed every run)")
    return 0 if not flaky and not always_failed else 1


if __name__ == "__main__":
    sys.exit(main())
