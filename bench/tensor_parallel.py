"""What tensor parallelism costs on this machine: one engine on 1 rank vs 2 ranks, in one alternating run.

Workload (bench/engine.py's): SmolLM2-135M-Instruct in float32, its 16 chat-templated questions x 128 greedy
new tokens (EOS ignored), in-process (``LLMEngine.generate``, no prefix cache), 16 at once and the first prompt
alone. TP1 runs one process on every core; TP2 runs two ranks of half the cores each (rank 0 in this process,
rank 1 spawned), meeting in two all-reduces a layer (gloo). The table shows medians, the ratio to TP1, the share
of rank 0's time spent in all-reduces (waiting for the other rank included), and whether the tokens agree.

On 2 CPU cores TP cannot win: the same arithmetic is split over the same cores, and each layer adds two
all-reduces through the kernel's loopback. It shows what the split costs, not a speed-up.

Run (not part of ``make test``; ~5 minutes): ``flock /tmp/kvmesh-bench.lock python bench/tensor_parallel.py
[--repeats 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402
from engine import chat_prompts, run_kvmesh  # noqa: E402


def make_engine(path: Path, size: int):
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine

    return LLMEngine(
        path,
        EngineConfig(
            num_blocks=512,
            max_num_seqs=32,
            max_num_batched_tokens=1024,
            enable_prefix_cache=False,
            tensor_parallel_size=size,
        ),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default="bench/results/tensor_parallel.json")
    args = ap.parse_args()

    from kvmesh.engine.default_model import default_model_path

    path = default_model_path()
    prompts = chat_prompts(path, 16)
    cores = torch.get_num_threads()
    engines = {}
    for size in (1, 2):
        t0 = time.perf_counter()
        engines[size] = make_engine(path, size)
        run_kvmesh(engines[size], prompts[:1], 4)  # warm-up
        print(f"  TP{size}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    samples = {size: {"batch": [], "alone": [], "all_reduce_share": []} for size in engines}
    tokens = {}
    try:
        for r in range(args.repeats):
            for size, engine in engines.items():
                torch.set_num_threads(max(1, cores // size))  # rank 0's share (process-wide in torch)
                link = engine.runner.tp.link if engine.runner.tp is not None else None
                before = link.all_reduce_seconds if link else 0.0
                s, batch = run_kvmesh(engine, prompts, args.new_tokens)
                samples[size]["batch"].append(len(prompts) * args.new_tokens / s)
                samples[size]["all_reduce_share"].append((link.all_reduce_seconds - before) / s if link else 0.0)
                s, alone = run_kvmesh(engine, prompts[:1], args.new_tokens)
                samples[size]["alone"].append(args.new_tokens / s)
                tokens[size] = batch
                print(
                    f"  round {r + 1} TP{size}: {samples[size]['batch'][-1]:.1f} tok/s x16, "
                    f"{samples[size]['alone'][-1]:.1f} alone",
                    flush=True,
                )
    finally:
        for engine in engines.values():
            engine.close()
    med = {size: {k: statistics.median(v) for k, v in s.items()} for size, s in samples.items()}
    rows = [
        [
            f"TP{size}",
            f"{m['batch']:.1f}",
            f"{m['batch'] / med[1]['batch']:.2f}x",
            f"{m['alone']:.1f}",
            f"{m['alone'] / med[1]['alone']:.2f}x",
            f"{100 * m['all_reduce_share']:.0f}%",
            "yes" if tokens[size] == tokens[1] else "no",
        ]
        for size, m in med.items()
    ]
    print(
        f"\nSmolLM2-135M-Instruct float32, 16 chat prompts x {args.new_tokens} greedy tokens, medians of {args.repeats}"
    )
    print_table(["ranks", "tok/s x16", "vs TP1", "tok/s x1", "vs TP1", "all-reduce share (x16)", "tokens as TP1"], rows)
    write_json(args.json, {"repeats": args.repeats, "new_tokens": args.new_tokens, "samples": samples, "medians": med})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
