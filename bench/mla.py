"""Multi-head Latent Attention against grouped-query attention of the same hidden size, in one run.

Two transformers-written random models (8 layers of 512, 8 heads, dense MLPs of 1408, float32): DeepSeek-V3's
MLA (a 128-wide latent + 32 rotary values a token and layer) and a Llama with 4 KV heads of 64. For each:
KV bytes a token, the blocks a 256 MiB pool holds, and the hand-off of a 4,000-token prompt (its blocks
exported from the engine that prefilled it and imported into another, in process: the bytes every
transport moves, and the copy's ms); then decode tokens/s with 16 requests at once and one alone (64-token
prompts, 64 greedy tokens, the best of ``--rounds`` alternating rounds), for MLA both as kvmesh runs it
(absorbed: every head attends to the latent rows) and expanded (the anchor: each sequence's latent
gathered from the pool and turned into per-head keys and values through kv_b_proj, as transformers does).

Run: ``python bench/mla.py [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import write_json  # noqa: E402
from _decode_speed import tokens_per_s  # noqa: E402
from _table import print_table  # noqa: E402

from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.engine.mla import MLADecoderLayer  # noqa: E402
from kvmesh.sampling import SamplingParams  # noqa: E402

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MLA = dict(
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    q_lora_rank=None,
    first_k_dense_replace=8,  # every MLP dense: the attention is what differs
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_group=1,
    topk_group=1,
)
GQA = dict(num_key_value_heads=4, head_dim=64)
POOL_BYTES = 256 << 20
HANDOFF_TOKENS = 4000


def write(path: Path, mla: bool) -> Path:
    import transformers

    torch.manual_seed(0)
    if mla:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE, **MLA))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **GQA))
    model.eval().save_pretrained(path)
    return path


def expanded_attention(self, ops, positions, hidden, kv_cache, cos_sin, meta, write_kv):
    """The anchor: MLA as transformers computes it, per sequence, reading the same latent pool."""
    cfg, mla = self.cfg, self.cfg.mla
    t, heads, eps = hidden.shape[0], cfg.num_heads, cfg.rms_norm_eps
    q = self.q_proj(hidden).view(t, heads, mla.qk_head_dim)
    q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
    c, k_pe = self.kv_a_proj(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    c = ops.rms_norm(c.contiguous(), self.kv_a_norm, eps)
    q_pe, k_pe = q_pe.contiguous(), k_pe.reshape(t, 1, mla.qk_rope_head_dim)
    q_pe, k_pe = ops.rotary_embedding(positions, torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], -1),
                                      torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], -1), cos_sin)  # fmt: skip
    rows = torch.cat([c, k_pe.reshape(t, -1)], dim=-1).unsqueeze(1)
    write_kv(ops, rows, rows, kv_cache, self.index, meta.slot_mapping)
    pool = kv_cache[self.index, 0].flatten(0, 1)[:, 0]  # [blocks * block_size, latent width]
    block_size = kv_cache.shape[3]
    query = torch.cat([q_nope, q_pe], dim=-1)
    out = []
    starts = meta.query_start_loc.tolist()
    for s, (lo, hi) in enumerate(zip(starts, starts[1:])):
        n = int(meta.seq_lens[s])
        slots = meta.block_tables[s, : -(-n // block_size)].repeat_interleave(block_size) * block_size
        slots = (slots + torch.arange(len(slots)) % block_size)[:n]
        latent = pool[slots]
        kv = self.kv_b_proj(latent[:, : mla.kv_lora_rank]).view(n, heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], -1)
        k = torch.cat([k_nope, latent[:, None, mla.kv_lora_rank :].expand(n, heads, -1)], -1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - (hi - lo), n)[:, None]
        o = F.scaled_dot_product_attention(
            query[lo:hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=cfg.attn_scale
        )
        out.append(o.transpose(0, 1).reshape(hi - lo, -1))
    return self.o_proj(torch.cat(out))


class Expanded:
    """The MLA engine with its layers' attention swapped for the expanded anchor while it runs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def generate(self, *args, **kwargs):
        absorbed = MLADecoderLayer.attention
        MLADecoderLayer.attention = expanded_attention
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            MLADecoderLayer.attention = absorbed


def handoff(path: Path) -> tuple[int, float]:
    """(bytes, ms) of a 4,000-token prompt's blocks exported from the engine that prefilled it and imported
    into another."""
    cfg = EngineConfig(num_blocks=300, max_model_len=HANDOFF_TOKENS + 16)
    prefill, decode = LLMEngine(path, cfg), LLMEngine(path, cfg)
    prompt = [(13 * i) % 8000 + 3 for i in range(HANDOFF_TOKENS)]
    prefill.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    hashes = prefill.prompt_block_hashes(prompt)
    t0 = time.perf_counter()
    blocks = prefill.export_blocks(hashes)
    decode.import_blocks(blocks)
    ms = (time.perf_counter() - t0) * 1e3
    return sum(len(p.data) for _, p in blocks), ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    report: dict = {"kv": {}, "tokens_per_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"MLA": write(Path(tmp) / "mla", True), "GQA": write(Path(tmp) / "gqa", False)}
        for name, path in paths.items():
            engine = LLMEngine(path, EngineConfig(num_blocks=16))
            per_token = engine.kv.block_nbytes // engine.config.block_size
            sent, ms = handoff(path)
            report["kv"][name] = {
                "bytes_per_token": per_token,
                "blocks_in_256MiB": POOL_BYTES // engine.kv.block_nbytes,
                "handoff_bytes": sent,
                "handoff_ms": ms,
            }
        mla = LLMEngine(paths["MLA"], EngineConfig(num_blocks=256))
        engines = {
            "MLA, absorbed (kvmesh)": mla,
            "MLA, expanded": Expanded(mla),
            "GQA": LLMEngine(paths["GQA"], EngineConfig(num_blocks=256)),
        }
        speeds = {name: {16: 0.0, 1: 0.0} for name in engines}
        for round_no in range(args.rounds):  # alternating: the machine drifts; each case's best round kept
            for name, engine in engines.items():
                for streams in (16, 1):
                    speeds[name][streams] = max(speeds[name][streams], tokens_per_s(engine, streams, round_no))
    report["tokens_per_s"] = speeds
    kv = report["kv"]
    print_table(
        ["attention", "KV B/token", "blocks in 256 MiB", f"hand-off of {HANDOFF_TOKENS} tokens", "copy ms"],
        [
            [n, str(k["bytes_per_token"]), str(k["blocks_in_256MiB"]), f"{k['handoff_bytes'] / 2**20:.1f} MiB",
             f"{k['handoff_ms']:.1f}"]
            for n, k in kv.items()
        ],
    )  # fmt: skip
    print()
    anchor = speeds["MLA, absorbed (kvmesh)"]
    print_table(
        ["decode", "tok/s x16", "absorbed / this", "tok/s x1", "absorbed / this"],
        [
            [n, f"{s[16]:.1f}", f"{anchor[16] / s[16]:.2f}", f"{s[1]:.1f}", f"{anchor[1] / s[1]:.2f}"]
            for n, s in speeds.items()
        ],
    )
    cpu = Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(" :\t")
    print(f"\n{cpu}, {torch.get_num_threads()} threads, float32")
    write_json(args.json, {"cpu": cpu, "rounds": args.rounds, **report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
