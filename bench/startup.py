"""Start-up of `kvmesh up` on the default model: eager, compiled with a cold cache, compiled with a warm one.

Each start runs the real CLI (`kvmesh up`, the compose file's default mesh) and times it until it
prints its banner (every health check passed: a decode worker reports SERVING only once its graphs
are built), then until a first chat answer, then how fast 16 streams of greedy chat decode over
the OpenAI API (the step path each start serves). The anchor is the eager start (`KVMESH_DECODE_COMPILE=0`)
in the same run; a round is eager, cold (a fresh compile cache), warm (the cache the cold start
filled), and rounds alternate the order of eager and the compiled pair.

    python bench/startup.py --rounds 2 --json bench/results/startup.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402
from engine import QUESTIONS  # noqa: E402

from kvmesh.launcher.up_process import kvmesh_up  # noqa: E402

STREAMS, NEW_TOKENS = 16, 64


def _chat(port: int, question: str, max_tokens: int) -> int:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)["usage"]["completion_tokens"]


def _streams_tok_s(port: int) -> float:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        tokens = sum(pool.map(lambda q: _chat(port, q, NEW_TOKENS), QUESTIONS[:STREAMS]))
    return tokens / (time.monotonic() - t0)


def start(run_dir: Path, compile_cache: Path, compiled: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env |= {"KVMESH_DECODE_COMPILE": str(int(compiled)), "KVMESH_COMPILE_CACHE": str(compile_cache)}
    flags = ["--device", "cpu", "--no-publish", "--log-level", "warning", "--start-timeout", "900"]
    with kvmesh_up(run_dir, *flags, env=env) as up:
        _chat(up.http_port, QUESTIONS[0], 16)
        answered = time.monotonic() - up.started_at
        _streams_tok_s(up.http_port)  # a first round of 16 pays one-off costs (allocator, caches): not counted
        tok_s = _streams_tok_s(up.http_port)
    return {"healthy_s": up.healthy_s, "answered_s": answered, "tok_s_16_streams": tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    kinds = ("eager", "compiled, cold cache", "compiled, warm cache")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            cache = Path(tmp) / f"compile-cache-{r}"  # fresh each round: the cold start fills it, the warm one reads it
            order = ["eager", *kinds[1:]] if r % 2 == 0 else [*kinds[1:], "eager"]
            for kind in order:
                run_dir = Path(tmp) / f"run-{r}-{kinds.index(kind)}"
                run_dir.mkdir()
                one = start(run_dir, cache, compiled=kind != "eager")
                runs[kind].append(one)
                print(f"round {r} {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in one.items()), flush=True)

    medians = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in runs.items()}
    eager = medians["eager"]
    rows = [
        [
            kind,
            f"{m['healthy_s']:.1f}",
            f"{m['healthy_s'] / eager['healthy_s']:.2f}x",
            f"{m['answered_s']:.1f}",
            f"{m['tok_s_16_streams']:.0f}",
            f"{m['tok_s_16_streams'] / eager['tok_s_16_streams']:.2f}x",
        ]
        for kind, m in medians.items()
    ]
    header = ["kvmesh up (median)", "healthy s", "vs eager", "first answer s", "tok/s, 16 streams", "vs eager"]
    print_table(header, rows)
    write_json(args.json, {"runs": runs, "medians": medians, "streams": STREAMS, "new_tokens": NEW_TOKENS})


if __name__ == "__main__":
    main()
