"""What tensor parallelism costs on this machine: one engine on 1 rank vs 2 ranks, in one alternating run.

Model: SmolLM2-135M-Instruct cannot split over 2 ranks (9 heads, 3 KV heads), so the default is bench/engine.py's
random ~30M Llama in float32 (8 heads, 4 KV heads, 8 layers, hidden 512; random 64-token prompts);
``--model default --sizes 1,3`` runs SmolLM2 over 3 ranks instead (3 processes on 2 cores: slower still).
Workload: 16 prompts x 128 greedy new tokens (EOS ignored), in-process (``LLMEngine.generate``, no prefix
cache), 16 at once and the first prompt alone. TP1 runs one process on every core; TPn runs n ranks of an
equal share of the cores (rank 0 in this process, the others its children), meeting in two all-reduces a
layer (through shared memory). The table shows medians, the ratio to TP1, the share of rank 0's time spent
in all-reduces (waiting for the other ranks included), and whether the tokens agree with TP1's.

A size may name the all-reduce: ``--sizes 1,2,2:gloo`` adds TP2 through a gloo process group (the
torch.distributed path CUDA ranks take with NCCL) beside TP2 through shared memory. A size ending in
``+compile`` runs its decode steps on compiled graphs (each rank its own, the all-reduce an op in them):
``--sizes 1,2,1+compile,2+compile``.

Then (``--part mesh``, or ``all``, the default) the TTFT of a fresh 4,000-token prompt through a real mesh for
the four pairs prefill TP1/TP2 x decode TP1/TP2 (bench/_tp_mesh_ttft.py), the TP1/TP1 mesh the anchor, with KV
over ``--kv-transport`` (nixl, the default, or grpc).

On 2 CPU cores TP cannot win: the same arithmetic is split over the same cores, and each layer adds two
all-reduces (through shared memory). It shows what the split costs, not a speed-up.

Run (not part of ``make test``; ~10 minutes): ``flock /tmp/kvmesh-bench.lock python bench/tensor_parallel.py
[--part engine|mesh|all] [--model random|default] [--sizes 1,2[,2:gloo][,2+compile]] [--repeats 3] [--ttft-tokens 4000]
[--kv-transport nixl|grpc] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402
from _tp_mesh_ttft import print_pairs, run_pairs  # noqa: E402
from engine import chat_prompts, run_kvmesh, write_model  # noqa: E402


def make_engine(path: Path, size: int, all_reduce: str | None = None, compile: bool = False):
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
            tp_all_reduce=all_reduce,
            compile=compile,
        ),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random", choices=("random", "default"))
    ap.add_argument(
        "--sizes",
        default="1,2",
        help="rank counts, the first the anchor; N:gloo: through a gloo group; N+compile: compiled decode steps",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--part", default="all", choices=("engine", "mesh", "all"))
    ap.add_argument("--ttft-tokens", type=int, default=4000)
    ap.add_argument("--ttft-prompts", type=int, default=2, help="fresh prompts per pair and round")
    ap.add_argument("--kv-transport", default="nixl", choices=("nixl", "grpc"), help="the mesh part's KV transport")
    ap.add_argument("--json", default="bench/results/tensor_parallel.json")
    args = ap.parse_args()
    report: dict = {}
    if args.part in ("engine", "all"):
        report["engine"] = engine_part(args)
    if args.part in ("mesh", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            pairs = run_pairs(Path(tmp), args.ttft_tokens, args.ttft_prompts, args.repeats, args.kv_transport)
        print_pairs(pairs, args.ttft_tokens)
        report["mesh_ttft"] = {"tokens": args.ttft_tokens, "pairs": pairs}
    write_json(args.json, report)
    return 0


def engine_part(args: argparse.Namespace) -> dict:
    """The in-process comparison (module docstring); its JSON part."""

    sizes = args.sizes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random":
            path = Path(tmp) / "llama-30m"
            write_model(path)
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(1, 8192, (64,), generator=g).tolist() for _ in range(16)]
        else:
            from kvmesh.engine.default_model import default_model_path

            path = default_model_path()
            prompts = chat_prompts(path, 16)
        return measure(path, prompts, sizes, args)


def parse_size(size: str) -> tuple[int, str | None, bool]:
    """ "N[:all-reduce][+compile]": (ranks, the all-reduce or None for the default, compiled)."""
    spec, _, mode = size.partition("+")
    ranks, _, all_reduce = spec.partition(":")
    return int(ranks), all_reduce or None, mode == "compile"


def measure(path: Path, prompts: list[list[int]], sizes: list[str], args: argparse.Namespace) -> dict:
    """``sizes``: "N", "N:all-reduce", either with "+compile", each; the first the anchor."""
    cores = torch.get_num_threads()
    anchor = sizes[0]
    engines = {}
    for size in sizes:
        ranks, all_reduce, compile = parse_size(size)
        t0 = time.perf_counter()
        # Every core to start from: a TP engine takes rank 0's share of them (process-wide), and inductor
        # writes the thread count it compiles under into its kernels.
        torch.set_num_threads(cores)
        engines[size] = make_engine(path, ranks, all_reduce, compile)
        run_kvmesh(engines[size], prompts[:1], 4)  # warm-up
        print(f"  TP{size}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    samples = {size: {"batch": [], "alone": [], "all_reduce_share": []} for size in engines}
    tokens = {}
    try:
        for r in range(args.repeats):
            for size, engine in engines.items():
                ranks = parse_size(size)[0]
                torch.set_num_threads(max(1, cores // ranks))  # rank 0's share (process-wide in torch)
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
            f"{m['batch'] / med[anchor]['batch']:.2f}x",
            f"{m['alone']:.1f}",
            f"{m['alone'] / med[anchor]['alone']:.2f}x",
            f"{100 * m['all_reduce_share']:.0f}%",
            "yes" if tokens[size] == tokens[anchor] else "no",
        ]
        for size, m in med.items()
    ]
    print(f"\n{args.model} model, float32, 16 prompts x {args.new_tokens} greedy tokens, medians of {args.repeats}")
    vs = f"vs TP{anchor}"
    print_table(["ranks", "tok/s x16", vs, "tok/s x1", vs, "all-reduce share (x16)", f"tokens as TP{anchor}"], rows)
    return {"model": args.model, "repeats": args.repeats, "new_tokens": args.new_tokens, "samples": samples,
            "medians": med}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
