"""Multi-LoRA throughput: 16 requests spread over 1, 4 and 8 adapters against the base model alone, one run.

    flock /tmp/kvmesh-bench.lock python bench/lora.py --json bench/results/lora.json

The real default model (SmolLM2-135M-Instruct, float32 on CPU) in-process, 16 chat-templated questions x
128 greedy tokens (EOS ignored), all in flight at once (continuous batching). Adapters are written by PEFT
on the same model (rank 16, random non-zero factors), targeting the attention projections (q, k, v, o) or
all seven; request i runs under adapter i mod N. The anchor is the base model on the same engine in the
same run; rounds alternate the configurations and the table reports medians. A LoRA engine has
``max_loras`` 8, so every adapter stays resident (what swapping costs is not measured here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402
from engine import chat_prompts  # noqa: E402

from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.sampling import SamplingParams  # noqa: E402
from tests.engine.peft_reference import write_peft_adapter  # noqa: E402

TARGETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, adapters)]
    out: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    elapsed = time.perf_counter() - t0
    return sum(len(v) for v in out.values()) / elapsed, [out[r] for r in rids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--targets", default="attention,all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="bench/results/lora.json")
    args = ap.parse_args()

    model = args.model or default_model_path()
    counts = [int(n) for n in args.adapters.split(",")]
    prompts = chat_prompts(model, args.requests)
    # The prefix cache would serve repeated prompts from the second round on: every round computes everything.
    engine = LLMEngine(model, EngineConfig(num_blocks=2048, max_loras=max(counts), max_lora_rank=args.rank,
                                           enable_prefix_cache=False))  # fmt: skip
    configs: list[tuple[str, list[str | None]]] = [("base", [None] * args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.targets.split(","):
            for i in range(max(counts)):
                path = write_peft_adapter(
                    model, Path(tmp) / f"{kind}-{i}", seed=i, r=args.rank, lora_alpha=2 * args.rank,
                    target_modules=TARGETS[kind],
                )  # fmt: skip
                engine.load_adapter(f"{kind}-{i}", path)
            for n in counts:
                configs.append((f"{n} x {kind}", [f"{kind}-{i % n}" for i in range(args.requests)]))
        run(engine, prompts[:2], [None, configs[-1][1][0]], 4)  # warm-up: first calls, slot uploads
        speeds: dict[str, list[float]] = {name: [] for name, _ in configs}
        for r in range(args.rounds):
            for name, adapters in configs if r % 2 == 0 else reversed(configs):
                speeds[name].append(run(engine, prompts, adapters, args.tokens)[0])
                print(f"round {r + 1}: {name}: {speeds[name][-1]:.1f} tok/s", flush=True)
    base = statistics.median(speeds["base"])
    rows, results = [], {}
    for name, _ in configs:
        med = statistics.median(speeds[name])
        results[name] = {"tok_s": speeds[name], "median_tok_s": med, "cost_vs_base": 1 - med / base}
        rows.append([name, f"{med:.1f}", f"{100 * (1 - med / base):+.1f}%"])
    print_table(["configuration (16 requests)", "tok/s (median)", "cost vs base"], rows)
    write_json(args.json, {"model": str(model), "rank": args.rank, "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
