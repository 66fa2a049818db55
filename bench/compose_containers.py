"""The compose mesh in containers: image sizes, build time cold and warm, time to healthy.

`scripts/compose_local.sh` builds the images from Debian's packages and runs
compose/docker-compose.cpu.yml under podman; the anchor is `kvmesh up`, the same compose file
as processes, started in the same run (rounds alternate: processes, containers, containers,
processes, ...). Time to healthy is from the start command to every service passing its own
health check (containers: podman's health status; processes: `kvmesh up` prints its banner
once every health check passed), then one greedy chat request is answered.

    python bench/compose_containers.py --cold --rounds 2 --json bench/results/compose_containers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.launcher.up_process import kvmesh_up  # noqa: E402
from kvmesh.runtime.ports import free_port  # noqa: E402

SCRIPT = REPO / "scripts" / "compose_local.sh"
IMAGES = ["localhost/kvmesh:cpu", "localhost/kvmesh-redis:bookworm", "localhost/kvmesh-base:bookworm"]


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")} | extra


def _chat(http_port: int) -> str:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/chat/completions",
        data=json.dumps(body | {"max_tokens": 16, "temperature": 0}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.load(reply)["choices"][0]["message"]["content"]


def build(fresh: bool) -> float:
    t0 = time.monotonic()
    env = _env(KVMESH_BUILD_FRESH="1") if fresh else _env()
    subprocess.run([str(SCRIPT), "images"], cwd=REPO, env=env, check=True, capture_output=True)
    return time.monotonic() - t0


def image_sizes() -> dict[str, int]:
    out = subprocess.run(["podman", "image", "inspect", *IMAGES], capture_output=True, text=True, check=True).stdout
    return {image: info["Size"] for image, info in zip(IMAGES, json.loads(out))}


def _healthy(project: str) -> bool:
    ids = subprocess.run(
        ["podman", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if not ids:
        return False
    states = json.loads(subprocess.run(["podman", "inspect", *ids], capture_output=True, text=True).stdout)
    return all(s["State"].get("Health", {}).get("Status") == "healthy" for s in states)


def containers_round(state: Path) -> dict[str, float]:
    project, http = f"kvmeshbench{os.getpid()}", free_port()
    env = _env(
        COMPOSE_PROJECT_NAME=project,
        KVMESH_COMPOSE_STATE=str(state),
        KVMESH_GATEWAY_HTTP_PORT=str(http),
        KVMESH_GATEWAY_PORT=str(free_port()),
    )
    t0 = time.monotonic()
    try:
        subprocess.run([str(SCRIPT), "up"], cwd=REPO, env=env, check=True, capture_output=True)
        while not _healthy(project):
            if time.monotonic() - t0 > 600:
                raise RuntimeError("containers not healthy after 600 s")
            time.sleep(1)
        healthy = time.monotonic() - t0
        _chat(http)
        answered = time.monotonic() - t0
    finally:
        t1 = time.monotonic()
        subprocess.run([str(SCRIPT), "down"], cwd=REPO, env=env, check=True, capture_output=True)
    return {"healthy_s": healthy, "answered_s": answered, "down_s": time.monotonic() - t1}


def processes_round(run_dir: Path) -> dict[str, float]:
    with kvmesh_up(run_dir, "--device", "cpu", "--no-publish", "--log-level", "warning", env=_env()) as up:
        _chat(up.http_port)
        answered = time.monotonic() - up.started_at
    return {"healthy_s": up.healthy_s, "answered_s": answered, "down_s": up.stop_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="first build every image from nothing (no layer cache)")
    parser.add_argument("--rounds", type=int, default=2, help="start-ups of each kind, alternating")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    builds = {}
    if args.cold:
        builds["cold_s"] = build(fresh=True)
    builds["warm_s"] = build(fresh=False)
    sizes = image_sizes()

    runs: dict[str, list[dict[str, float]]] = {"processes (kvmesh up)": [], "containers (compose)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for kind in order:
                where = Path(tmp) / f"{kind.split()[0]}-{r}"
                where.mkdir()
                one = processes_round(where) if kind.startswith("processes") else containers_round(where)
                runs[kind].append(one)
                print(f"round {r} {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in one.items()), flush=True)

    medians = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}
    print_table(["image", "size (MB)"], [[image, f"{size / 1e6:.0f}"] for image, size in sizes.items()])
    print()
    print_table(["build", "seconds"], [[k.removesuffix("_s"), f"{v:.1f}"] for k, v in builds.items()])
    print()
    rows = [
        [kind, f"{m['healthy_s']:.1f}", f"{m['answered_s']:.1f}", f"{m['down_s']:.1f}"] for kind, m in medians.items()
    ]
    print_table(["start (median)", "healthy s", "first answer s", "stop s"], rows)
    write_json(args.json, {"image_bytes": sizes, "build_s": builds, "startup_runs": runs, "startup_medians": medians})


if __name__ == "__main__":
    main()
