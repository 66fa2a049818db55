"""The Mixture-of-Experts path against its anchors, in one run.

A transformers-written random Qwen3-MoE sized so that the experts dominate a step (8 layers of 512,
16 experts of width 704, 2 a token: 553 MB of expert weights in float32 against 26 MB of attention),
serving 16 requests at once and one alone (64-token prompts, 64 greedy tokens, EOS ignored, eager
steps, the best of ``--rounds`` rounds that alternate the cases):

- **grouped**: kvmesh's ``moe_experts`` (pairs sorted by expert once, one product pair per expert
  with tokens);
- **per-expert loop**: the same engine with the experts computed as transformers' eager
  ``Qwen3MoeExperts`` does (a one-hot mask, then per expert hit a ``where`` over it, a gather, the
  products and an ``index_add_``), the naive anchor;
- **dense, same active**: a Qwen3 with the same attention and one MLP as wide as the two experts a
  token uses (1408), so the same parameters per token;
- **TP2** (every expert's columns split) and **TP2 + EP2** (half the experts whole on each rank): two
  rank processes on this machine's cores.

The weights a step must read explain the 16-at-once gap to the dense model: 16 tokens route to nearly
all 16 experts, 8x the dense MLP's bytes; one token reads 2 experts, the dense model's bytes.

Run: ``python bench/moe.py [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import write_json  # noqa: E402
from _decode_speed import tokens_per_s  # noqa: E402
from _table import print_table  # noqa: E402

from kernels import reference  # noqa: E402
from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
EXPERTS, TOP_K, EXPERT_WIDTH = 16, 2, 704
MOE = dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True)
DENSE = dict(intermediate_size=TOP_K * EXPERT_WIDTH)


def per_expert_loop(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """``moe_experts`` as transformers' eager experts compute it: a loop over the experts hit, each finding
    its tokens with ``where`` on a one-hot mask."""
    gated = reference.MOE_ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids, num_classes=w_gate_up.shape[0]).permute(2, 1, 0)
    for expert in (mask.sum(dim=(-1, -2)) > 0).nonzero():
        slot, token = torch.where(mask[expert[0]])
        y = F.linear(gated(F.linear(x[token], w_gate_up[expert[0]])), w_down[expert[0]])
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype))
    return out


def write(path: Path, moe: bool) -> Path:
    import transformers

    torch.manual_seed(0)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE, **MOE, intermediate_size=1408))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, **DENSE))
    model.eval().save_pretrained(path)
    return path


class LoopEngine:
    """The grouped engine with its experts' op swapped for the per-expert loop while it runs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def generate(self, *args, **kwargs):
        ops = self.engine.model.ops
        grouped, ops.moe_experts = ops.moe_experts, per_expert_loop
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            ops.moe_experts = grouped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    cfg = EngineConfig(num_blocks=256)
    with tempfile.TemporaryDirectory() as tmp:
        moe_path, dense_path = write(Path(tmp) / "moe", True), write(Path(tmp) / "dense", False)
        grouped = LLMEngine(moe_path, cfg)
        one_rank_threads = torch.get_num_threads()
        engines = {
            "grouped (kvmesh)": grouped,
            "per-expert loop": LoopEngine(grouped),
            "dense, same active": LLMEngine(dense_path, cfg),
            "TP2, experts by columns": LLMEngine(moe_path, EngineConfig(num_blocks=256, tensor_parallel_size=2)),
            "TP2 + EP2": LLMEngine(
                moe_path, EngineConfig(num_blocks=256, tensor_parallel_size=2, expert_parallel=True)
            ),
        }
        # Rank 0 of a tensor-parallel engine runs on one core (its rank on another): the process-wide thread
        # count it set is restored for the one-rank cases.
        rank_threads = torch.get_num_threads()
        dtype = str(grouped.runner.dtype).removeprefix("torch.")
        results = {name: {16: 0.0, 1: 0.0} for name in engines}
        try:
            for round_no in range(args.rounds):  # alternating: the machine drifts; each case's best round kept
                for name, engine in engines.items():
                    torch.set_num_threads(rank_threads if name.startswith("TP2") else one_rank_threads)
                    for streams in (16, 1):
                        speed = tokens_per_s(engine, streams, round_no)
                        results[name][streams] = max(results[name][streams], speed)
        finally:
            for engine in engines.values():
                if isinstance(engine, LLMEngine):
                    engine.close()
    anchor = results["grouped (kvmesh)"]
    rows = [
        [name, f"{r[16]:.1f}", f"{anchor[16] / r[16]:.2f}", f"{r[1]:.1f}", f"{anchor[1] / r[1]:.2f}"]
        for name, r in results.items()
    ]
    print_table(["case", "tok/s x16", "grouped / this", "tok/s x1", "grouped / this"], rows)
    cpu = Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(" :\t")
    print(f"\n{cpu}, {one_rank_threads} threads on one rank, {rank_threads} a rank at TP2, {dtype}")
    write_json(
        args.json,
        {"cpu": cpu, "dtype": dtype, "rounds": args.rounds, "tokens_per_s": results, "shape": {**SHAPE, **MOE}},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
