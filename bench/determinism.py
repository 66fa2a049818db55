"""What deterministic serving costs: tokens/s with and without ``--deterministic``, in one alternating run.

Workload (bench/engine.py's): SmolLM2-135M-Instruct, its 16 chat-templated questions x 128 greedy new
tokens (EOS ignored), in-process (``LLMEngine.generate``, no prefix cache), 16 at once and the first
prompt alone, float32 and bfloat16. Engines per dtype:
  - ``eager``: the engine's default path without compiled graphs (the anchor);
  - ``deterministic``: ``EngineConfig(deterministic=True)``: batch-invariant ops, decode eager;
  - ``compiled`` (``--compiled``): the workers' default (``--compile``), its graphs from the compile cache
    when they are there (a cold cache compiles for minutes).
Per dtype every engine is built (and warmed up) first, then they take turns for ``--repeats`` rounds;
the table shows medians, each engine's ratio to the anchor, and whether the deterministic engine's
tokens alone equal its tokens in the batch (they must). Time to first token of a 2,000-token prompt
alone shows what the invariant products cost a prefill.

Over HTTP (``--http``): per dtype, ``kvmesh up`` twice, side by side (``--no-publish``, no speculator): at its
defaults (decode compiled, graphs from the compile cache) and with ``--deterministic``; the two meshes take
turns serving bench/peers.py's HTTP rounds (16 concurrent streaming ``/v1/completions`` of the same prompts,
then 1), and the table shows medians and the ratio to the default mesh.

Run (not part of ``make test``; ~10 minutes in-process, as much again with ``--http``, more with a cold compile
cache): ``flock /tmp/kvmesh-bench.lock python bench/determinism.py [--repeats 3] [--compiled] [--http]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402
from engine import chat_prompts, make_engine, run_kvmesh  # noqa: E402

LONG_PROMPT = 2000


def ttft(engine, prompt: list[int]) -> float:
    """Seconds to the first token of ``prompt`` alone (its whole prefill)."""
    from kvmesh.sampling import SamplingParams

    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - t0


def measure_dtype(path: Path, dtype: str, names: list[str], prompts, new_tokens: int, repeats: int) -> list[dict]:
    engines = {}
    for name in names:
        t0 = time.perf_counter()
        engines[name] = make_engine(path, dtype, compile=name == "compiled", deterministic=name == "deterministic")
        print(f"  {dtype} {name}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    long_prompt = (sum(prompts, []) * (LONG_PROMPT // len(sum(prompts, [])) + 1))[:LONG_PROMPT]
    samples: dict[str, dict[str, list[float]]] = {n: {"batch": [], "alone": [], "ttft": []} for n in names}
    outputs: dict[str, dict[str, list]] = {n: {} for n in names}
    for r in range(repeats):
        for name, engine in engines.items():
            s, batch = run_kvmesh(engine, prompts, new_tokens)
            samples[name]["batch"].append(len(prompts) * new_tokens / s)
            s, alone = run_kvmesh(engine, prompts[:1], new_tokens)
            samples[name]["alone"].append(new_tokens / s)
            samples[name]["ttft"].append(ttft(engine, long_prompt))
            outputs[name] = {"batch_first": batch[0], "alone": alone[0]}
            print(
                f"  round {r + 1} {dtype} {name}: {samples[name]['batch'][-1]:.1f} tok/s x16, "
                f"{samples[name]['alone'][-1]:.1f} alone, TTFT {samples[name]['ttft'][-1]:.2f} s",
                flush=True,
            )
    rows = []
    for name in names:
        rows.append(
            {
                "dtype": dtype,
                "engine": name,
                "tok_s_16": statistics.median(samples[name]["batch"]),
                "tok_s_1": statistics.median(samples[name]["alone"]),
                "ttft_2000_s": statistics.median(samples[name]["ttft"]),
                "alone_equals_batched": outputs[name]["alone"] == outputs[name]["batch_first"],
                "samples": samples[name],
            }
        )
    return rows


def measure_http(dtype: str, prompts, new_tokens: int, repeats: int, workdir: Path) -> list[dict]:
    """Both meshes of ``dtype`` up at once, taking turns: tok/s of 16 streams and of 1."""
    import asyncio
    import os

    from peers import http_round

    from kvmesh.launcher.up_process import kvmesh_up

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")} | {"KVMESH_DTYPE": dtype}
    flags = ["--device", "cpu", "--no-publish", "--no-speculator", "--log-level", "warning", "--start-timeout", "900"]
    modes = {"default": [], "deterministic": ["--deterministic"]}
    samples = {m: {"batch": [], "alone": []} for m in modes}
    with contextlib.ExitStack() as stack:
        urls = {}
        for mode, extra in modes.items():
            run_dir = workdir / f"{dtype}-{mode}"
            run_dir.mkdir()
            up = stack.enter_context(kvmesh_up(run_dir, *flags, *extra, env=env))
            urls[mode] = f"http://127.0.0.1:{up.http_port}"
            print(f"  {dtype} {mode} mesh: healthy in {up.healthy_s:.0f} s", flush=True)
            asyncio.run(http_round(urls[mode], "smollm2-135m-instruct", prompts, 8))  # warm-up
        for r in range(repeats):
            for mode, url in urls.items():
                batch = asyncio.run(http_round(url, "smollm2-135m-instruct", prompts, new_tokens))
                alone = asyncio.run(http_round(url, "smollm2-135m-instruct", prompts[:1], new_tokens))
                samples[mode]["batch"].append(batch["tokens_per_s"])
                samples[mode]["alone"].append(alone["tokens_per_s"])
                print(
                    f"  round {r + 1} {dtype} HTTP {mode}: {batch['tokens_per_s']:.1f} tok/s x16, "
                    f"{alone['tokens_per_s']:.1f} alone",
                    flush=True,
                )
    return [
        {
            "dtype": dtype,
            "mesh": mode,
            "tok_s_16": statistics.median(s["batch"]),
            "tok_s_1": statistics.median(s["alone"]),
            "samples": s,
        }
        for mode, s in samples.items()
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--compiled", action="store_true", help="also the compiled default path (--compile)")
    ap.add_argument("--http", action="store_true", help="also through kvmesh up meshes over HTTP")
    ap.add_argument("--json", default="bench/results/determinism.json")
    args = ap.parse_args()

    from kvmesh.engine.default_model import default_model_path

    path = default_model_path()
    prompts = chat_prompts(path, 16)
    names = ["eager", "deterministic"] + (["compiled"] if args.compiled else [])
    rows = []
    for dtype in args.dtypes.split(","):
        rows += measure_dtype(path, dtype, names, prompts, args.new_tokens, args.repeats)

    anchor = {r["dtype"]: r for r in rows if r["engine"] == "eager"}
    table = []
    for r in rows:
        a = anchor[r["dtype"]]
        table.append(
            [
                r["dtype"],
                r["engine"],
                f"{r['tok_s_16']:.1f}",
                f"{r['tok_s_16'] / a['tok_s_16']:.2f}x",
                f"{r['tok_s_1']:.1f}",
                f"{r['tok_s_1'] / a['tok_s_1']:.2f}x",
                f"{r['ttft_2000_s']:.2f}",
                f"{r['ttft_2000_s'] / a['ttft_2000_s']:.2f}x",
                "yes" if r["alone_equals_batched"] else "no",
            ]
        )
    print(f"\nSmolLM2-135M-Instruct, 16 chat prompts x {args.new_tokens} greedy tokens, medians of {args.repeats}")
    headers = ["dtype", "engine", "tok/s x16", "vs eager", "tok/s x1", "vs eager", "TTFT 2k s", "vs eager"]
    print_table([*headers, "alone == batched"], table)
    http_rows = []
    if args.http:
        with tempfile.TemporaryDirectory(prefix="kvmesh-determinism-") as workdir:
            for dtype in args.dtypes.split(","):
                http_rows += measure_http(dtype, prompts, args.new_tokens, args.repeats, Path(workdir))
        base = {r["dtype"]: r for r in http_rows if r["mesh"] == "default"}
        print(f"\nOver HTTP (kvmesh up, no speculator), medians of {args.repeats}")
        print_table(
            ["dtype", "mesh", "tok/s x16", "vs default", "tok/s x1", "vs default"],
            [
                [
                    r["dtype"],
                    r["mesh"],
                    f"{r['tok_s_16']:.1f}",
                    f"{r['tok_s_16'] / base[r['dtype']]['tok_s_16']:.2f}x",
                    f"{r['tok_s_1']:.1f}",
                    f"{r['tok_s_1'] / base[r['dtype']]['tok_s_1']:.2f}x",
                ]
                for r in http_rows
            ],
        )
    write_json(args.json, {"repeats": args.repeats, "new_tokens": args.new_tokens, "rows": rows, "http": http_rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
