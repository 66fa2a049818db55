"""Triton kernels on a GPU: bf16/fp8 correctness against the torch references, then speed
against ceilings measured in the same run.

1. Ceilings: a 1 GiB device-to-device copy (bytes read + written) and an 8192³ bf16
   torch.matmul, both on random data.
2. Correctness, fresh random inputs, outputs poisoned (torch.empty gives NaN): every
   kernel in bf16 (attention also in fp32/tf32) against ``kernels.reference`` run in
   float32 on the upcast inputs, by ‖out − ref‖/‖ref‖; the fp8 quantizer against the
   reference bit for bit; bitwise batch invariance (alone vs. in a batch of 37); the
   timed attention shapes themselves.
3. Timings, ``triton.testing.do_bench`` medians (L2 flushed between runs), Llama-3-8B
   shapes (32 query heads, 8 KV heads, head_dim 128, block 16, shuffled block tables):
   decode attention as GB/s and % of the copy ceiling at batch×context 64×4k and 8×32k;
   prefill (8k) and extend (7k prefix + 1k new) attention as TFLOP/s and % of the
   matmul ceiling; both against SDPA on the same unpaged shapes; fp8 × bf16 matmul
   against the bf16 matmul; the elementwise kernels as GB/s; the fused MoE experts (Qwen3-30B-A3B's
   128 experts, 8 per token) as GB/s of expert weights at 16 tokens and TFLOP/s at 4096; MLA decode
   (DeepSeek-V3: 128 heads over one 512 + 64 latent row a token) as GB/s of the latent rows read,
   against the torch reference (the generic decode kernel does not launch at that width).
4. A small sweep of attention tile configurations, to inform the block-size heuristics.

Run ``bench/kernels_gpu.sh`` on a CUDA machine (no installs). JSON goes to
``$OUT/kernels_gpu.json`` when OUT is set, else ``bench/results/kernels_gpu.json``.
Exit status: 0 all checks passed, 1 a check failed or a section raised, 2 no CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from _table import print_table  # noqa: E402

DEVICE = "cuda"
# A dry run checks each code path once: of variants that run the same lines it keeps a few (``on_gpu_all``).
DRY = False
# --dry-run divides the token and row counts by this (and runs on the CPU in Triton's interpreter),
# so the script's every line runs in tests without a GPU.
SCALE = 1
# Llama-3-8B attention and MLP shapes.
HQ, HK, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336
DECODE_CASES = [(64, 4096), (8, 32768)]  # (batch, context)
PREFILL_CASES = [(4, 0, 8192), (8, 7168, 1024)]  # (batch, cached prefix, new tokens)
FP8_CASES = [
    (16, 2 * INTERMEDIATE, HIDDEN),
    (4096, 2 * INTERMEDIATE, HIDDEN),
    (16, HIDDEN, INTERMEDIATE),
    (4096, HIDDEN, INTERMEDIATE),
]  # fmt: skip  (M, N, K): gate_up and down projections
# Qwen3-30B-A3B's routed experts: hidden, per-expert intermediate, experts, experts per token.
MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOPK = 2048, 768, 128, 8
MOE_CASES = [(16, True), (4096, False)]  # (tokens, bound by the expert weights' bytes rather than FLOPs)
# DeepSeek-V3's Multi-head Latent Attention: query heads, latent values (the value columns), rotary values.
MLA_HEADS, MLA_RANK, MLA_ROPE = 128, 512, 64
MLA_DECODE_CASES = [(64, 4096), (8, 32768)]  # (batch, context)
# The 16-bit dtype every "bf16" check runs in: float16 on a dry run, whose interpreter computes
# bfloat16 wrongly (numpy has none).
LOWP = torch.bfloat16
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 2e-3}  # 16-bit operands; tf32 dots
UNOWNED = 1.0e4  # cache slots past a sequence's end: a kernel that reads them is far off


def n(count: int) -> int:
    """A token or row count, shrunk on a dry run."""
    return max(1, count // SCALE)


def dry_run_sizes() -> None:
    """Tiny shapes on the CPU: every section runs, in minutes, in Triton's interpreter."""
    global DEVICE, SCALE, LOWP, HIDDEN, INTERMEDIATE, DECODE_CASES, PREFILL_CASES, FP8_CASES
    global MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MLA_HEADS, MLA_DECODE_CASES, DRY
    DRY, DEVICE, SCALE, LOWP, HIDDEN, INTERMEDIATE = True, "cpu", 64, torch.float16, 256, 512
    MOE_HIDDEN, MOE_INTER, MOE_EXPERTS = 128, 96, 16
    MLA_HEADS, MLA_DECODE_CASES = 24, [(2, 64)]  # the latent keeps its width: its two dots are what runs
    DECODE_CASES, PREFILL_CASES = [(2, 64)], [(1, 0, 64), (1, 48, 16)]
    FP8_CASES = [(1, 2 * INTERMEDIATE, HIDDEN), (64, HIDDEN, INTERMEDIATE)]


# ----------------------------------------------------------------------------- pure helpers


def on_gpu_all(variants: list, dry: list[int]) -> list:
    """Every variant on a GPU; on a dry run only those at the ``dry`` indices (the interpreter takes seconds
    a sequence, and the other variants run the same lines of code with other numbers)."""
    return [variants[i] for i in dry] if DRY else variants


def decode_bytes(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, elem_bytes: int = 2) -> int:
    """The fewest bytes a decode step moves: every cached K and V row once, q in, out back,
    and the block tables (int32)."""
    kv = 2 * batch * context * kv_heads * head_dim * elem_bytes
    q_and_out = 2 * batch * q_heads * head_dim * elem_bytes
    tables = batch * math.ceil(context / BLOCK_SIZE) * 4
    return kv + q_and_out + tables


def mla_decode_bytes(batch: int, context: int, heads: int, dim: int, v_dim: int, elem_bytes: int = 2) -> int:
    """The fewest bytes an MLA decode step moves: every latent row once (keys and values alike), q in,
    out back, and the block tables (int32)."""
    latent = batch * context * dim * elem_bytes
    q_and_out = batch * heads * (dim + v_dim) * elem_bytes
    tables = batch * math.ceil(context / BLOCK_SIZE) * 4
    return latent + q_and_out + tables


def mla_decode_flops(batch: int, context: int, heads: int, dim: int, v_dim: int) -> float:
    """q·K over the latent's whole width and P @ V over its value columns, for every head and row."""
    return 2.0 * batch * heads * context * (dim + v_dim)


def attention_flops(batch: int, prefix: int, new: int, q_heads: int, head_dim: int) -> float:
    """QKᵀ and PV, 2 FLOPs per multiply-add each, over the (query, key) pairs a causal extend
    computes: each new token sees the whole prefix and the new tokens up to itself."""
    pairs = new * prefix + new * (new + 1) // 2
    return 4.0 * batch * q_heads * head_dim * pairs


def matmul_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def moe_flops(tokens: int, top_k: int, hidden: int, inter: int) -> float:
    """Each (token, expert) pair's gate, up and down products: three hidden x inter matmuls of one row."""
    return 3 * matmul_flops(tokens * top_k, hidden, inter)


def moe_weight_bytes(topk_ids: torch.Tensor, hidden: int, inter: int, elem_bytes: int = 2) -> int:
    """The expert weights a batch must read at least once: gate, up and down of each expert it routes to."""
    return topk_ids.unique().numel() * 3 * hidden * inter * elem_bytes


def default_json_path(environ: Mapping[str, str]) -> Path:
    out = environ.get("OUT")
    return Path(out) / "kernels_gpu.json" if out else REPO / "bench" / "results" / "kernels_gpu.json"


def rope_table(max_pos: int, head_dim: int, theta: float = 500000.0) -> torch.Tensor:
    """A float32 [max_pos, head_dim] cos | sin table, the layout the engine passes."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@dataclass
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def paged_kv(lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, device: str) -> PagedKV:
    """Random caches holding exactly these sequences, their blocks in shuffled order; the slots
    past each sequence's end hold UNOWNED."""
    blocks = [math.ceil(n / BLOCK_SIZE) for n in lens]
    total = sum(blocks)
    shape = (total, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    perm = torch.randperm(total, device=device, dtype=torch.int32)
    tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32, device=device)
    start = 0
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
        last, used = perm[start - 1].item(), n - (nb - 1) * BLOCK_SIZE
        k_cache[last, used:] = UNOWNED
        v_cache[last, used:] = UNOWNED
    return PagedKV(k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=device))


def moe_routing(tokens: int, experts: int, top_k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's output: each token's top_k distinct experts by random scores, their softmax as weights."""
    scores, ids = torch.randn(tokens, experts, device=device).topk(top_k, dim=-1)
    return ids, scores.softmax(-1)


def moe_expert_weights(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate_up [E, 2I, H] and w_down [E, H, I] in the 16-bit dtype, scaled so each product is O(1)."""
    w_gate_up = torch.randn(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, device=device) / MOE_HIDDEN**0.5
    w_down = torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, device=device) / MOE_INTER**0.5
    return w_gate_up.to(LOWP), w_down.to(LOWP)


def query_start_loc(new_tokens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(new_tokens)], dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- the report


@dataclass
class Report:
    device: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    sweeps: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def check(self, name: str, err: float, tolerance: float) -> None:
        ok = err <= tolerance  # inf (a NaN in the output) never passes
        self.checks.append({"name": name, "rel_err": err, "tolerance": tolerance, "ok": ok})
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tolerance:.0e})")

    def check_true(self, name: str, ok: bool, note: str = "") -> None:
        self.checks.append({"name": name, "rel_err": 0.0 if ok else math.inf, "tolerance": 0.0, "ok": ok,
                            "note": note})  # fmt: skip
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {note}")

    @property
    def passed(self) -> bool:
        return not self.errors and all(c["ok"] for c in self.checks)


def guarded(report: Report, section: str, run: Callable[[], None]) -> None:
    """Run one section; an exception is recorded (in ``report.errors``) and the next section still runs."""
    print(f"\n== {section}", flush=True)
    t0 = time.perf_counter()
    try:
        run()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # surface asynchronous launch errors inside their section
    except Exception:
        report.errors.append(f"{section}: {traceback.format_exc(limit=6)}")
        print(f"  ERROR in {section}:\n{traceback.format_exc(limit=6)}")
    print(f"  ({section}: {time.perf_counter() - t0:.1f} s)", flush=True)


def bench_ms(fn: Callable[[], object]) -> float:
    if DEVICE != "cuda":  # a dry run: the interpreter's time says nothing, the code path is what counts
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


# ----------------------------------------------------------------------------- sections


def measure_ceilings(report: Report) -> None:
    src = torch.randn(n(1 << 29), device=DEVICE, dtype=LOWP)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    report.ceilings["copy_GBps"] = 2 * src.numel() * 2 / ms / 1e6
    side = n(8192)
    a = torch.randn(side, side, device=DEVICE, dtype=LOWP)
    b = torch.randn(side, side, device=DEVICE, dtype=LOWP)
    ms = bench_ms(lambda: a @ b)
    report.ceilings["matmul_bf16_TFLOPs"] = matmul_flops(side, side, side) / ms / 1e9
    c = report.ceilings
    print(f"  copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s")


def check_elementwise(report: Report, k: Any) -> None:
    from kernels import reference
    from kernels.triton.testing import poisoned_allocations, relative_error

    bf16, dev, eps = LOWP, DEVICE, 1e-6
    x = torch.randn(n(1000), HIDDEN, device=dev).to(bf16)
    res = torch.randn(n(1000), HIDDEN, device=dev).to(bf16)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).to(bf16)
    with poisoned_allocations():
        out = k.rms_norm(x, w, eps)
        fused, summed = k.fused_add_rms_norm(x, res, w, eps)
    report.check("rms_norm bf16", relative_error(out, reference.rms_norm(x.float(), w.float(), eps)), 1e-2)
    ref_fused, ref_summed = reference.fused_add_rms_norm(x, res, w, eps)
    report.check("fused_add_rms_norm bf16", relative_error(fused, ref_fused.float()), 1e-2)
    report.check_true("fused_add_rms_norm residual sum bitwise", torch.equal(summed, ref_summed))

    rows = n(777)
    qkv = torch.randn(rows, (HQ + 2 * HK) * HEAD_DIM, device=dev).to(bf16)
    q = qkv[:, : HQ * HEAD_DIM].view(rows, HQ, HEAD_DIM)
    kk = qkv[:, HQ * HEAD_DIM : (HQ + HK) * HEAD_DIM].view(rows, HK, HEAD_DIM)
    v = qkv[:, (HQ + HK) * HEAD_DIM :].view(rows, HK, HEAD_DIM)
    qn_w = torch.randn(HEAD_DIM, device=dev).to(bf16)
    with poisoned_allocations():
        qn = k.rms_norm(q, qn_w, eps)
    qn_ref = reference.rms_norm(q.float(), qn_w.float(), eps)
    report.check("rms_norm bf16 over strided heads", relative_error(qn, qn_ref), 1e-2)

    gate_up = (2 * torch.randn(n(1000), 2 * INTERMEDIATE, device=dev)).to(bf16)
    with poisoned_allocations():
        out = k.silu_and_mul(gate_up)
    report.check("silu_and_mul bf16", relative_error(out, reference.silu_and_mul(gate_up.float())), 1e-2)
    with poisoned_allocations():
        out = k.gelu_tanh_and_mul(gate_up)
    ref = reference.gelu_tanh_and_mul(gate_up.float())
    report.check("gelu_tanh_and_mul bf16", relative_error(out, ref), 1e-2)

    positions = torch.randint(0, 8192, (rows,), device=dev)
    table = rope_table(8192, HEAD_DIM).to(dev)
    with poisoned_allocations():
        q_rot, k_rot = k.rotary_embedding(positions, q, kk, table)
    q_ref, k_ref = reference.rotary_embedding(positions, q.float(), kk.float(), table)
    report.check("rotary q bf16", relative_error(q_rot, q_ref), 1e-2)
    report.check("rotary k bf16", relative_error(k_rot, k_ref), 1e-2)

    slots = torch.randperm(64 * BLOCK_SIZE, device=dev)[:rows]  # no slot written twice
    slots[torch.randperm(rows, device=dev)[: rows * 3 // 8]] = -1  # padding
    cache_shape = (64, BLOCK_SIZE, HK, HEAD_DIM)
    kc, vc = (torch.full(cache_shape, float("nan"), device=dev, dtype=bf16) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    k.write_kv_cache(kk, v, kc, vc, slots)
    reference.write_kv_cache(kk, v, kr, vr, slots)
    same = all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in ((kc, kr), (vc, vr)))
    report.check_true("write_kv_cache bf16 exact, padding and other slots untouched", same)


def check_attention(report: Report, k: Any) -> None:
    from kernels import reference
    from kernels.triton.testing import poisoned_allocations, relative_error

    dev = DEVICE
    # (kv heads, group, head_dim, dtype): MHA, GQA 4 and 8, a smaller and a larger head, fp32 (tf32 dots).
    variants = [(8, 1, 128, LOWP), (8, 4, 128, LOWP), (4, 8, 128, LOWP),
                (8, 4, 64, LOWP), (2, 4, 256, LOWP), (8, 4, 128, torch.float32)]  # fmt: skip
    for hk, group, d, dtype in on_gpu_all(variants, [1, 5]):
        name = f"Hk={hk} G={group} D={d} {str(dtype).removeprefix('torch.')}"
        lens = [1, 16, n(257), n(1000), n(4097), n(20000)] + torch.randint(2, n(3000) + 2, (2,)).tolist()
        kv = paged_kv(lens, hk, d, dtype, dev)
        q = torch.randn(len(lens), hk * group, d, device=dev).to(dtype)
        with poisoned_allocations():
            out = k.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, d**-0.5)
        ref = reference.paged_decode_attention(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables,
                                               kv.seq_lens, d**-0.5)  # fmt: skip
        report.check(f"decode {name}", relative_error(out, ref), TOLERANCE[dtype])

        cases = [(0, n(1000)), (77, 1), (n(500), n(129)), (n(4000), n(300)), (0, 3), (1, 64)]  # (prefix, new tokens)
        news = [n for _, n in cases]
        kv = paged_kv([p + n for p, n in cases], hk, d, dtype, dev)
        qsl = query_start_loc(news, dev)
        q = torch.randn(sum(news), hk * group, d, device=dev).to(dtype)
        with poisoned_allocations():
            out = k.paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, d**-0.5)
        ref = reference.paged_extend_attention(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables,
                                               qsl, kv.seq_lens, d**-0.5)  # fmt: skip
        report.check(f"extend {name}", relative_error(out, ref), TOLERANCE[dtype])


def check_sliding_window(report: Report, k: Any) -> None:
    """Sliding-window attention (Mistral's 4096 keys, and a window shorter than a key tile) against the
    reference's masked softmax: the decode starts its splits at the window, the extend's compiled
    WINDOWED variant masks each row's window start. Then a windowed decode's bits alone vs in a batch
    (the window's span, not the sequence's length, sizes its splits)."""
    from kernels import reference
    from kernels.triton.testing import poisoned_allocations, relative_error

    dev = DEVICE
    variants = list(itertools.product([(8, 4, 128, LOWP), (8, 4, 128, torch.float32)], (n(4096), 17)))
    for (hk, group, d, dtype), window in on_gpu_all(variants, [0, 3]):
        name = f"window={window} Hk={hk} G={group} D={d} {str(dtype).removeprefix('torch.')}"
        lens = [1, 16, n(257), n(1000), n(4097), n(20000)] + torch.randint(2, n(3000) + 2, (2,)).tolist()
        kv = paged_kv(lens, hk, d, dtype, dev)
        q = torch.randn(len(lens), hk * group, d, device=dev).to(dtype)
        with poisoned_allocations():
            out = k.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, d**-0.5, window)
        ref = reference.paged_decode_attention(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables,
                                               kv.seq_lens, d**-0.5, window)  # fmt: skip
        report.check(f"decode {name}", relative_error(out, ref), TOLERANCE[dtype])

        # (prefix, new tokens): new tokens past the window's length, over prefixes shorter and longer than it.
        cases = [(0, n(1000)), (77, 1), (n(4200), n(300)), (n(9000), n(129)), (0, 3)]
        news = [n for _, n in cases]
        kv = paged_kv([p + n for p, n in cases], hk, d, dtype, dev)
        qsl = query_start_loc(news, dev)
        q = torch.randn(sum(news), hk * group, d, device=dev).to(dtype)
        with poisoned_allocations():
            out = k.paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, d**-0.5,
                                           window)  # fmt: skip
        ref = reference.paged_extend_attention(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables,
                                               qsl, kv.seq_lens, d**-0.5, window)  # fmt: skip
        report.check(f"extend {name}", relative_error(out, ref), TOLERANCE[dtype])

    batch, at, window = 9, 5, n(4096)  # few: the interpreter of a dry run takes seconds a sequence
    lens = torch.randint(1, n(12000) + 1, (batch,)).tolist()
    lens[at] = n(20000)
    kv = paged_kv(lens, HK, HEAD_DIM, LOWP, dev)
    q = torch.randn(batch, HQ, HEAD_DIM, device=dev).to(LOWP)
    batched = k.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.088, window)
    alone = k.paged_decode_attention(q[at : at + 1], kv.k_cache, kv.v_cache, kv.block_tables[at : at + 1],
                                     kv.seq_lens[at : at + 1], 0.088, window)  # fmt: skip
    report.check_true(f"decode window={window} bitwise alone vs batch of {batch}", torch.equal(alone[0], batched[at]))


def check_batch_invariance(report: Report, k: Any) -> None:
    dev, (batch, at) = DEVICE, ((9, 5) if DRY else (37, 17))
    lens = torch.randint(1, n(3000) + 1, (batch,)).tolist()
    lens[at] = n(5000)
    kv = paged_kv(lens, HK, HEAD_DIM, LOWP, dev)
    q = torch.randn(batch, HQ, HEAD_DIM, device=dev).to(LOWP)
    batched = k.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.088)
    alone = k.paged_decode_attention(q[at : at + 1], kv.k_cache, kv.v_cache, kv.block_tables[at : at + 1],
                                     kv.seq_lens[at : at + 1], 0.088)  # fmt: skip
    report.check_true("decode bitwise alone vs batch of 37", torch.equal(alone[0], batched[at]))

    news = torch.randint(1, n(300) + 1, (batch,)).tolist()
    prefixes = torch.randint(0, n(2000) + 1, (batch,)).tolist()
    news[at], prefixes[at] = n(700), n(1500)
    kv = paged_kv([p + n for p, n in zip(prefixes, news)], HK, HEAD_DIM, LOWP, dev)
    qsl = query_start_loc(news, dev)
    q = torch.randn(sum(news), HQ, HEAD_DIM, device=dev).to(LOWP)
    batched = k.paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, 0.088)
    a, b = int(qsl[at]), int(qsl[at + 1])
    alone = k.paged_extend_attention(q[a:b], kv.k_cache, kv.v_cache, kv.block_tables[at : at + 1],
                                     torch.tensor([0, b - a], dtype=torch.int32, device=dev),
                                     kv.seq_lens[at : at + 1], 0.088)  # fmt: skip
    report.check_true("extend bitwise alone vs batch of 37", torch.equal(alone, batched[a:b]))
    check_deterministic_serving_kernels(report, k)


def check_deterministic_serving_kernels(report: Report, k: Any) -> None:
    """What ``--deterministic`` adds on a GPU: the fixed-tile product (a row's bits in any batch, and
    against torch) and the extend whose every row is its decode."""
    from kernels import reference
    from kernels.triton import INVARIANT_KERNELS
    from kernels.triton.testing import relative_error

    dev = DEVICE
    w, bias = torch.randn(HIDDEN, INTERMEDIATE, device=dev).to(LOWP), torch.randn(HIDDEN, device=dev).to(LOWP)
    for dtype in (LOWP, torch.float32):
        wd, bd = w.to(dtype), bias.to(dtype)
        x = torch.randn(n(300), INTERMEDIATE, device=dev).to(dtype)
        together = k.invariant_mm(x, wd, bd)
        ref = reference.invariant_mm(x, wd, bd)
        report.check(f"invariant_mm {str(dtype)[6:]} vs torch", relative_error(together, ref), TOLERANCE[dtype])
        rows = (0, 77 % len(x))
        rows_same = all(torch.equal(k.invariant_mm(x[i : i + 1], wd, bd), together[i : i + 1]) for i in rows)
        report.check_true(f"invariant_mm {str(dtype)[6:]} bitwise alone vs {len(x)} rows", rows_same)
    every_row = INVARIANT_KERNELS["paged_extend_attention"]
    new = n(200)
    kv = paged_kv([new], HK, HEAD_DIM, LOWP, dev)
    q = torch.randn(new, HQ, HEAD_DIM, device=dev).to(LOWP)
    whole = every_row(q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc([new], dev), kv.seq_lens, 0.088)
    i = new // 2
    decode = k.paged_decode_attention(q[i : i + 1], kv.k_cache, kv.v_cache, kv.block_tables,
                                      torch.tensor([i + 1], dtype=torch.int32, device=dev), 0.088)  # fmt: skip
    report.check_true("deterministic extend row == its decode", torch.equal(decode[0], whole[i]))


def _check_fp8_values(report: Report, q: torch.Tensor, rq: torch.Tensor) -> None:
    # Triton's fp32 division may differ from torch's by an ulp, which can flip a value sitting
    # on an fp8 rounding boundary: allow a rare one-step difference, never more.
    ours, theirs = q.float(), rq.float()
    fraction = (ours != theirs).float().mean().item()
    # One e4m3 step is at most 1/8 of the larger neighbour, or 2^-9 among the subnormals.
    one_step = (ours - theirs).abs() <= torch.maximum(ours.abs().maximum(theirs.abs()) / 8, torch.tensor(2.0**-9))
    report.check_true("fp8 quantized values match the reference", fraction < 1e-4 and bool(one_step.all()),
                      f"({fraction:.1e} of values one step apart)")  # fmt: skip


def _check_fp8_model(report: Report) -> None:
    from torch import nn

    from kernels.quantized_linear import quantize_model
    from kernels.triton.testing import relative_error

    dev = DEVICE
    model = nn.Sequential(nn.Linear(HIDDEN, 1024), nn.SiLU(), nn.Linear(1024, 512, bias=False)).to(dev, LOWP)
    x = torch.randn(33, HIDDEN, device=dev).to(LOWP)
    with torch.no_grad():
        before = model(x).float()
        replaced = quantize_model(model, "fp8")
        after = model(x)
    report.check_true("quantize_model(fp8) replaced both linears", replaced == 2)
    report.check("fp8 QuantizedLinear model vs bf16 model (fp8 weight error)", relative_error(after, before), 5e-2)


def check_8bit_weights(report: Report, k: Any) -> None:
    from kernels import reference
    from kernels.quantized_linear import quantize_int8_weight
    from kernels.triton.testing import poisoned_allocations, relative_error

    dev = DEVICE
    rows, cols = n(4096), n(4000)
    weight = (torch.randn(rows, cols, device=dev) * torch.logspace(-3, 1, rows, device=dev)[:, None]).to(LOWP)
    weight[11] = 0
    with poisoned_allocations():
        q, scale = k.quantize_fp8_weight(weight)
    rq, rscale = reference.quantize_fp8_weight(weight)
    report.check("fp8 quantize scales", relative_error(scale, rscale), 1e-6)
    if DEVICE != "cuda":
        print("  skip fp8 quantized values: the interpreter rounds to fp8 wrongly (tests/kernels/test_fp8.py)")
    else:
        _check_fp8_values(report, q, rq)
    for m in (1, 16, 100, n(4096)):
        x = torch.randn(m, cols, device=dev).to(LOWP)
        bias = torch.randn(rows, device=dev).to(LOWP)
        with poisoned_allocations():
            out = k.fp8_scaled_mm(x, rq, rscale, bias)
        ref = reference.fp8_scaled_mm(x.float(), rq, rscale, bias.float())
        report.check(f"fp8_scaled_mm bf16 x fp8 M={m}", relative_error(out, ref), 1e-2)

    if DEVICE != "cuda":
        print("  skip quantize_model(fp8): fp8 linears need CUDA")
    else:
        _check_fp8_model(report)

    # int8 weights run the same Triton matmul (the widening is the only difference).
    iq, iscale = quantize_int8_weight(weight)
    for m in (1, 16, n(4096)):
        x = torch.randn(m, cols, device=dev).to(LOWP)
        with poisoned_allocations():
            out = k.int8_scaled_mm(x, iq, iscale, None)
        report.check(
            f"int8_scaled_mm bf16 x int8 M={m}",
            relative_error(out, reference.int8_scaled_mm(x.float(), iq, iscale)),
            1e-2,
        )


def check_lora(report: Report, k: Any) -> None:
    """LoRA's batched add (several adapters and base-model rows in one batch) against the reference."""
    from kernels import reference
    from kernels.lora_segments import LoraSegments
    from kernels.triton.testing import poisoned_allocations, relative_error

    runs = [(0, n(1000)), (2, 1), (-1, 3), (1, 1), (2, n(300)), (3, 17)]  # (slot, tokens): prefills, decodes, base
    segments = LoraSegments.build(runs, torch.device(DEVICE))
    tokens = sum(count for _, count in runs)
    for rank, n_out in ((16, HIDDEN), (48, 2 * INTERMEDIATE)):
        x = torch.randn(tokens, HIDDEN, device=DEVICE).to(LOWP)
        a = (torch.randn(4, rank, HIDDEN, device=DEVICE) / HIDDEN**0.5).to(LOWP)
        b = torch.randn(4, rank, n_out, device=DEVICE).to(LOWP)
        y = torch.randn(tokens, n_out, device=DEVICE).to(LOWP)
        ours, ref = y.clone(), y.float()
        with poisoned_allocations():
            k.lora_add(ours, x, a, b, segments)
        reference.lora_add(ref, x.float(), a.float(), b.float(), segments)
        report.check(f"lora_add bf16 rank={rank} out={n_out}", relative_error(ours, ref), 1e-2)
        base = torch.tensor([s < 0 for s, count in runs for _ in range(count)], device=DEVICE)
        report.check_true(f"lora_add rank={rank}: base-model rows untouched", torch.equal(ours[base], y[base]))


def check_moe(report: Report, k: Any) -> None:
    """The fused MoE experts in bf16, both activations, against the reference in float32 on the upcast
    inputs (one token: most experts idle; a few thousand: every expert's rows over several tiles), a
    token's bits alone vs in a batch, and (on CUDA) that the call never waits for the device."""
    from kernels import reference
    from kernels.triton.testing import poisoned_allocations, relative_error

    dev = DEVICE
    w_gate_up, w_down = moe_expert_weights(dev)
    for tokens, activation in itertools.product((1, n(3000)), ("silu", "gelu_tanh")):
        x = torch.randn(tokens, MOE_HIDDEN, device=dev).to(LOWP)
        ids, weights = moe_routing(tokens, MOE_EXPERTS, MOE_TOPK, dev)
        with poisoned_allocations():
            out = k.moe_experts(x, ids, weights, w_gate_up, w_down, activation)
        ref = reference.moe_experts(x.float(), ids, weights, w_gate_up.float(), w_down.float(), activation)
        report.check(f"moe_experts bf16 {activation} T={tokens}", relative_error(out, ref), 1e-2)

    batch, at = 38, 17  # 304 pairs: a multiple of 16, which Triton would compile a variant for
    x = torch.randn(batch, MOE_HIDDEN, device=dev).to(LOWP)
    ids, weights = moe_routing(batch, MOE_EXPERTS, MOE_TOPK, dev)
    batched = k.moe_experts(x, ids, weights, w_gate_up, w_down, "silu")
    alone = k.moe_experts(x[at : at + 1], ids[at : at + 1], weights[at : at + 1], w_gate_up, w_down, "silu")
    report.check_true(f"moe_experts bitwise alone vs batch of {batch}", torch.equal(alone[0], batched[at]))

    if DEVICE != "cuda":
        print("  skip moe_experts host-sync check: it needs CUDA's sync debug mode")
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        k.moe_experts(x, ids, weights, w_gate_up, w_down, "silu")
        synced = ""
    except RuntimeError as exc:
        synced = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    report.check_true("moe_experts makes no host sync", not synced, synced)


def check_mla(report: Report, k: Any) -> None:
    """MLA decode at DeepSeek-V3's width against the reference in float32 on the upcast inputs: 16-bit at
    its 128 heads and per rank at TP4 and TP8 (each head count has its own head block), and float32
    (tf32 dots); then a sequence's bits alone vs in a batch."""
    from kernels import reference
    from kernels.triton.testing import poisoned_allocations, relative_error

    dev, dim, scale = DEVICE, MLA_RANK + MLA_ROPE, 192**-0.5  # DeepSeek-V3's q·k head width is 128 + 64
    for heads, dtype in ((MLA_HEADS, LOWP), (32, LOWP), (16, LOWP), (MLA_HEADS, torch.float32)):
        lens = [1, 16, n(257), n(1000), n(4097), n(20000)] + torch.randint(2, n(3000) + 2, (2,)).tolist()
        kv = paged_kv(lens, 1, dim, dtype, dev)
        q = torch.randn(len(lens), heads, dim, device=dev).to(dtype)
        with poisoned_allocations():
            out = k.mla_decode_attention(q, kv.k_cache, kv.block_tables, kv.seq_lens, scale, MLA_RANK)
        ref = reference.mla_decode_attention(q.float(), kv.k_cache.float(), kv.block_tables, kv.seq_lens, scale,
                                             MLA_RANK)  # fmt: skip
        name = f"mla_decode H={heads} D={dim} v={MLA_RANK} {str(dtype).removeprefix('torch.')}"
        report.check(name, relative_error(out, ref), TOLERANCE[dtype])

    batch, at = 9, 5  # few: the interpreter of a dry run takes seconds a sequence
    lens = torch.randint(1, n(12000) + 1, (batch,)).tolist()
    lens[at] = n(20000)
    kv = paged_kv(lens, 1, dim, LOWP, dev)
    q = torch.randn(batch, MLA_HEADS, dim, device=dev).to(LOWP)
    batched = k.mla_decode_attention(q, kv.k_cache, kv.block_tables, kv.seq_lens, scale, MLA_RANK)
    alone = k.mla_decode_attention(q[at : at + 1], kv.k_cache, kv.block_tables[at : at + 1],
                                   kv.seq_lens[at : at + 1], scale, MLA_RANK)  # fmt: skip
    report.check_true(f"mla_decode bitwise alone vs batch of {batch}", torch.equal(alone[0], batched[at]))


def time_decode(report: Report, k: Any) -> None:
    import torch.nn.functional as F

    from kernels import reference
    from kernels.triton.testing import relative_error

    for batch, context in DECODE_CASES:
        kv = paged_kv([context] * batch, HK, HEAD_DIM, LOWP, DEVICE)
        q = torch.randn(batch, HQ, HEAD_DIM, device=DEVICE).to(LOWP)
        scale = HEAD_DIM**-0.5

        def ours() -> torch.Tensor:
            return k.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)

        ref = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
        report.check(f"decode {batch}x{context} (timed shape)", relative_error(ours(), ref.float()), 1e-2)
        del ref
        ms = bench_ms(ours)
        gbps = decode_bytes(batch, context, HQ, HK, HEAD_DIM) / ms / 1e6
        sdpa_ms, sdpa_how = _sdpa_decode_ms(F, batch, context)
        report.timings.append({
            "kernel": "paged_decode_attention", "shape": f"{batch}x{context}", "ms": ms, "GBps": gbps,
            "pct_of_copy": 100 * gbps / report.ceilings["copy_GBps"], "sdpa_ms": sdpa_ms,
            "speedup_vs_sdpa": sdpa_ms / ms, "sdpa": sdpa_how,
        })  # fmt: skip
        del kv


def time_mla(report: Report, k: Any) -> None:
    """MLA decode at DeepSeek-V3's shapes (128 heads, 512 + 64 latent, block 16): GB/s of the latent
    rows (each read once at best) against the copy ceiling, and TFLOP/s against the matmul: 128 heads
    make it about as much arithmetic as bytes (64x4k: 0.3 GB, 73 GFLOP). The anchor is the torch
    reference on the same bf16 inputs (the generic decode kernel does not launch at this width)."""
    from kernels import reference
    from kernels.triton.testing import relative_error

    dim, scale = MLA_RANK + MLA_ROPE, 192**-0.5
    for batch, context in MLA_DECODE_CASES:
        latent = paged_kv([context] * batch, 1, dim, LOWP, DEVICE)
        q = torch.randn(batch, MLA_HEADS, dim, device=DEVICE).to(LOWP)
        args = (q, latent.k_cache, latent.block_tables, latent.seq_lens, scale, MLA_RANK)
        out, ref = k.mla_decode_attention(*args), reference.mla_decode_attention(*args)
        report.check(f"mla_decode {batch}x{context} (timed shape)", relative_error(out, ref.float()), 1e-2)
        del out, ref
        ms = bench_ms(lambda: k.mla_decode_attention(*args))
        ref_ms = bench_ms(lambda: reference.mla_decode_attention(*args))
        gbps = mla_decode_bytes(batch, context, MLA_HEADS, dim, MLA_RANK) / ms / 1e6
        tflops = mla_decode_flops(batch, context, MLA_HEADS, dim, MLA_RANK) / ms / 1e9
        report.timings.append({
            "kernel": "mla_decode_attention", "shape": f"{batch}x{context} H={MLA_HEADS}", "ms": ms, "GBps": gbps,
            "pct_of_copy": 100 * gbps / report.ceilings["copy_GBps"], "TFLOPs": tflops,
            "pct_of_matmul": 100 * tflops / report.ceilings["matmul_bf16_TFLOPs"], "torch_reference_ms": ref_ms,
            "speedup_vs_torch_reference": ref_ms / ms,
        })  # fmt: skip
        del latent


def _sdpa_decode_ms(F: Any, batch: int, context: int) -> tuple[float, str]:
    q = torch.randn(batch, HQ, 1, HEAD_DIM, device=DEVICE, dtype=LOWP)
    kk = torch.randn(batch, HK, context, HEAD_DIM, device=DEVICE, dtype=LOWP)
    v = torch.randn_like(kk)
    try:
        F.scaled_dot_product_attention(q, kk, v, enable_gqa=True)
        return bench_ms(lambda: F.scaled_dot_product_attention(q, kk, v, enable_gqa=True)), "enable_gqa"
    except (TypeError, RuntimeError):
        group = HQ // HK
        kk, v = kk.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return bench_ms(lambda: F.scaled_dot_product_attention(q, kk, v)), "k/v expanded to Hq heads"


def time_extend(report: Report, k: Any) -> None:
    import torch.nn.functional as F

    from kernels import reference
    from kernels.triton.testing import relative_error

    for batch, prefix, new in PREFILL_CASES:
        kv = paged_kv([prefix + new] * batch, HK, HEAD_DIM, LOWP, DEVICE)
        qsl = query_start_loc([new] * batch, DEVICE)
        q = torch.randn(batch * new, HQ, HEAD_DIM, device=DEVICE).to(LOWP)
        scale = HEAD_DIM**-0.5

        def ours() -> torch.Tensor:
            return k.paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, scale)

        one = slice(0, new)  # the reference on the first sequence: the whole batch would need ~35 GB of scores
        ref = reference.paged_extend_attention(q[one], kv.k_cache, kv.v_cache, kv.block_tables[:1], qsl[:2],
                                               kv.seq_lens[:1], scale)  # fmt: skip
        report.check(f"extend {batch}x({prefix}+{new}) (timed shape, first sequence)",
                     relative_error(ours()[one], ref.float()), 1e-2)  # fmt: skip
        del ref
        ms = bench_ms(ours)
        tflops = attention_flops(batch, prefix, new, HQ, HEAD_DIM) / ms / 1e9
        sdpa_ms = _sdpa_extend_ms(F, batch, prefix, new)
        name = "prefill" if prefix == 0 else "extend"
        report.timings.append({
            "kernel": f"paged_extend_attention ({name})", "shape": f"{batch}x({prefix}+{new})", "ms": ms,
            "TFLOPs": tflops, "pct_of_matmul": 100 * tflops / report.ceilings["matmul_bf16_TFLOPs"],
            "sdpa_ms": sdpa_ms, "speedup_vs_sdpa": sdpa_ms / ms if sdpa_ms else None,
        })  # fmt: skip
        del kv


def _sdpa_extend_ms(F: Any, batch: int, prefix: int, new: int) -> float | None:
    """SDPA on the same unpaged shapes, K/V expanded to the query heads so the flash/cuDNN
    kernels take it; the causal mask aligned to the bottom right when there is a prefix."""
    q = torch.randn(batch, HQ, new, HEAD_DIM, device=DEVICE, dtype=LOWP)
    kk = torch.randn(batch, HQ, prefix + new, HEAD_DIM, device=DEVICE, dtype=LOWP)
    v = torch.randn_like(kk)
    if prefix == 0:
        return bench_ms(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True))
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return None
    mask = causal_lower_right(new, prefix + new)
    return bench_ms(lambda: F.scaled_dot_product_attention(q, kk, v, attn_mask=mask))


def time_fp8(report: Report, k: Any) -> None:
    for m, n, kd in FP8_CASES:
        x = torch.randn(m, kd, device=DEVICE).to(LOWP)
        w = torch.randn(n, kd, device=DEVICE).to(LOWP)
        q, scale = k.quantize_fp8_weight(w)
        bf16_ms = bench_ms(lambda: torch.matmul(x, w.t()))
        fp8_ms = bench_ms(lambda: k.fp8_scaled_mm(x, q, scale))
        invariant_ms = bench_ms(lambda: k.invariant_mm(x, w))  # deterministic serving's product
        flops = matmul_flops(m, n, kd)
        for kernel, ms, weight_bytes in (("fp8_scaled_mm", fp8_ms, n * kd), ("invariant_mm", invariant_ms, 2 * n * kd)):
            report.timings.append({
                "kernel": kernel, "shape": f"M={m} N={n} K={kd}", "ms": ms, "TFLOPs": flops / ms / 1e9,
                "bf16_matmul_ms": bf16_ms, "speedup_vs_bf16_matmul": bf16_ms / ms,
                "weight_GBps": weight_bytes / ms / 1e6,
            })  # fmt: skip


def time_elementwise(report: Report, k: Any) -> None:
    from kernels import reference

    t, bf16, dev = n(8192), LOWP, DEVICE
    x = torch.randn(t, HIDDEN, device=dev).to(bf16)
    res = torch.randn(t, HIDDEN, device=dev).to(bf16)
    w = torch.ones(HIDDEN, device=dev, dtype=bf16)
    gate_up = torch.randn(t, 2 * INTERMEDIATE, device=dev).to(bf16)
    q = torch.randn(t, HQ, HEAD_DIM, device=dev).to(bf16)
    kk = torch.randn(t, HK, HEAD_DIM, device=dev).to(bf16)
    positions = torch.randint(0, 8192, (t,), device=dev)
    table = rope_table(8192, HEAD_DIM).to(dev)
    cache = torch.empty(t // BLOCK_SIZE, BLOCK_SIZE, HK, HEAD_DIM, device=dev, dtype=bf16)
    cache_v = torch.empty_like(cache)
    slots = torch.randperm(t, device=dev)
    e = 2  # bytes per bf16
    cases = [  # (name, ours, the reference, bytes read + written)
        ("rms_norm", lambda: k.rms_norm(x, w, 1e-6), lambda: reference.rms_norm(x, w, 1e-6), 2 * x.numel() * e),
        ("fused_add_rms_norm", lambda: k.fused_add_rms_norm(x, res, w, 1e-6),
         lambda: reference.fused_add_rms_norm(x, res, w, 1e-6), 4 * x.numel() * e),
        ("silu_and_mul", lambda: k.silu_and_mul(gate_up), lambda: reference.silu_and_mul(gate_up),
         gate_up.numel() * e * 3 // 2),
        ("gelu_tanh_and_mul", lambda: k.gelu_tanh_and_mul(gate_up), lambda: reference.gelu_tanh_and_mul(gate_up),
         gate_up.numel() * e * 3 // 2),
        ("rotary_embedding", lambda: k.rotary_embedding(positions, q, kk, table),
         lambda: reference.rotary_embedding(positions, q, kk, table), 2 * (q.numel() + kk.numel()) * e),
        ("write_kv_cache", lambda: k.write_kv_cache(kk, kk, cache, cache_v, slots),
         lambda: reference.write_kv_cache(kk, kk, cache, cache_v, slots), 4 * kk.numel() * e),
    ]  # fmt: skip
    for name, ours, ref, nbytes in cases:
        ms, ref_ms = bench_ms(ours), bench_ms(ref)
        gbps = nbytes / ms / 1e6
        report.timings.append({
            "kernel": name, "shape": f"T={t}", "ms": ms, "GBps": gbps,
            "pct_of_copy": 100 * gbps / report.ceilings["copy_GBps"], "torch_reference_ms": ref_ms,
            "speedup_vs_torch_reference": ref_ms / ms,
        })  # fmt: skip


def time_moe(report: Report, k: Any) -> None:
    """The fused MoE experts at a decode step's 16 tokens (bound by the expert weights it reads: GB/s of
    them) and a 4096-token prefill chunk (TFLOP/s), against the reference's loop over experts in bf16."""
    from kernels import reference

    w_gate_up, w_down = moe_expert_weights(DEVICE)
    for count, weight_bound in MOE_CASES:
        tokens = n(count)
        x = torch.randn(tokens, MOE_HIDDEN, device=DEVICE).to(LOWP)
        ids, weights = moe_routing(tokens, MOE_EXPERTS, MOE_TOPK, DEVICE)
        args = (x, ids, weights, w_gate_up, w_down, "silu")
        ms, ref_ms = bench_ms(lambda: k.moe_experts(*args)), bench_ms(lambda: reference.moe_experts(*args))
        shape = f"T={tokens} E={MOE_EXPERTS} k={MOE_TOPK} H={MOE_HIDDEN} I={MOE_INTER}"
        row = {"kernel": "moe_experts", "shape": shape, "ms": ms, "torch_reference_ms": ref_ms,
               "speedup_vs_torch_reference": ref_ms / ms}  # fmt: skip
        if weight_bound:
            gbps = moe_weight_bytes(ids, MOE_HIDDEN, MOE_INTER) / ms / 1e6
            row |= {"GBps": gbps, "pct_of_copy": 100 * gbps / report.ceilings["copy_GBps"]}
        else:
            tflops = moe_flops(tokens, MOE_TOPK, MOE_HIDDEN, MOE_INTER) / ms / 1e9
            row |= {"TFLOPs": tflops, "pct_of_matmul": 100 * tflops / report.ceilings["matmul_bf16_TFLOPs"]}
        report.timings.append(row)


def sweep_mla(report: Report, k: Any, deadline: float) -> None:
    """Time other MLA decode tiles and shortest splits on the timed shapes (every tile here compiles for
    sm_90 without spills; the first is what ``_mla_config`` picks at 128 heads in bf16)."""
    from kernels.triton import mla_decode

    # (BLOCK_H, BLOCK_N, warps, stages, shortest split)
    variants = [(64, 16, 8, 3, 2048), (64, 16, 8, 2, 2048), (32, 32, 8, 3, 2048), (32, 16, 4, 3, 2048),
                (16, 32, 4, 3, 2048), (16, 32, 4, 2, 2048), (64, 16, 8, 3, 256), (64, 16, 8, 3, 1024),
                (64, 16, 8, 3, 4096)]  # fmt: skip
    dim = MLA_RANK + MLA_ROPE
    for batch, context in MLA_DECODE_CASES:
        latent = paged_kv([context] * batch, 1, dim, LOWP, DEVICE)
        q = torch.randn(batch, MLA_HEADS, dim, device=DEVICE).to(LOWP)
        for block_h, block_n, warps, stages, min_split in variants:
            if time.monotonic() > deadline:
                return
            cfg = {"BLOCK_H": block_h, "BLOCK_N": block_n, "MIN_SPLIT_TOKENS": min_split, "num_warps": warps,
                   "num_stages": stages}  # fmt: skip
            with mock.patch.object(mla_decode, "_mla_config", lambda h, e, cfg=cfg: dict(cfg)):
                ms = bench_ms(lambda: k.mla_decode_attention(q, latent.k_cache, latent.block_tables,
                                                             latent.seq_lens, 0.072, MLA_RANK))  # fmt: skip
            gbps = mla_decode_bytes(batch, context, MLA_HEADS, dim, MLA_RANK) / ms / 1e6
            report.sweeps.append({"kernel": "mla_decode", "shape": f"{batch}x{context}", **cfg, "ms": ms,
                                  "GBps": gbps})  # fmt: skip
        del latent


def sweep_attention(report: Report, k: Any, deadline: float) -> None:
    """Time other tile configurations on the timed shapes, to tune the heuristics next time."""
    from kernels.triton import decode_attention, extend_attention, fp8

    decode_variants = [(block_n, warps, stages, min_split) for block_n, warps, stages in
                       [(64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 8, 2)] for min_split in (256, 1024)]  # fmt: skip
    for batch, context in DECODE_CASES:
        kv = paged_kv([context] * batch, HK, HEAD_DIM, LOWP, DEVICE)
        q = torch.randn(batch, HQ, HEAD_DIM, device=DEVICE).to(LOWP)
        for block_n, warps, stages, min_split in decode_variants:
            if time.monotonic() > deadline:
                return
            cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            with mock.patch.object(decode_attention, "_decode_config", lambda d, cfg=cfg: cfg), \
                    mock.patch.object(decode_attention, "_MIN_SPLIT_TOKENS", min_split):  # fmt: skip
                ms = bench_ms(lambda: k.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                                               kv.seq_lens, 0.088))  # fmt: skip
            gbps = decode_bytes(batch, context, HQ, HK, HEAD_DIM) / ms / 1e6
            report.sweeps.append({"kernel": "decode", "shape": f"{batch}x{context}", **cfg,
                                  "min_split_tokens": min_split, "ms": ms, "GBps": gbps})  # fmt: skip
        del kv
    extend_variants = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4)]
    for batch, prefix, new in PREFILL_CASES:
        kv = paged_kv([prefix + new] * batch, HK, HEAD_DIM, LOWP, DEVICE)
        qsl = query_start_loc([new] * batch, DEVICE)
        q = torch.randn(batch * new, HQ, HEAD_DIM, device=DEVICE).to(LOWP)
        for block_m, block_n, warps, stages in extend_variants:
            if time.monotonic() > deadline:
                return
            cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            with mock.patch.object(extend_attention, "_extend_config", lambda d, cfg=cfg: cfg):
                ms = bench_ms(lambda: k.paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                                               kv.seq_lens, 0.088))  # fmt: skip
            tflops = attention_flops(batch, prefix, new, HQ, HEAD_DIM) / ms / 1e9
            report.sweeps.append({"kernel": "extend", "shape": f"{batch}x({prefix}+{new})", **cfg, "ms": ms,
                                  "TFLOPs": tflops})  # fmt: skip
        del kv
    fp8_variants = {  # decode-sized or not: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
        True: [
            (16, 64, 128, 4, 4),
            (16, 32, 256, 4, 4),
            (16, 64, 256, 4, 3),
            (16, 32, 128, 4, 6),
            (16, 128, 128, 4, 4),
        ],
        False: [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4)],
    }
    for m, n, kd in FP8_CASES:
        x = torch.randn(m, kd, device=DEVICE).to(LOWP)
        qweight, scale = k.quantize_fp8_weight(torch.randn(n, kd, device=DEVICE).to(LOWP))
        for block_m, block_n, block_k, warps, stages in fp8_variants[m <= 64]:
            if time.monotonic() > deadline:
                return
            cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps,
                   "num_stages": stages}  # fmt: skip
            with mock.patch.object(fp8, "_matmul_config", lambda m, n, cfg=cfg: cfg):
                ms = bench_ms(lambda: k.fp8_scaled_mm(x, qweight, scale))
            report.sweeps.append({"kernel": "fp8_scaled_mm", "shape": f"M={m} N={n} K={kd}", **cfg, "ms": ms,
                                  "TFLOPs": matmul_flops(m, n, kd) / ms / 1e9})  # fmt: skip


# ----------------------------------------------------------------------------- output


def _fmt(v: object, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 0.1 or v == 0 else f"{v:.3g}"
    return str(v)


_ANCHORS = (("speedup_vs_sdpa", "x SDPA"), ("speedup_vs_bf16_matmul", "x bf16 mm"),
            ("speedup_vs_torch_reference", "x torch ref"))  # fmt: skip


def _timing_row(t: dict[str, Any]) -> list[str]:
    if "GBps" in t:
        rate, of_ceiling = f"{_fmt(t['GBps'], 0)} GB/s", f"{_fmt(t['pct_of_copy'], 0)}% copy"
        if "TFLOPs" in t:  # bound by both (MLA decode): show the two
            rate += f", {_fmt(t['TFLOPs'], 0)} TFLOP/s"
            of_ceiling += f", {_fmt(t['pct_of_matmul'], 0)}% matmul"
    else:
        rate = f"{_fmt(t['TFLOPs'], 0)} TFLOP/s"
        of_ceiling = f"{_fmt(t['pct_of_matmul'], 0)}% matmul" if "pct_of_matmul" in t else ""
    anchor = next((f"{_fmt(t[key], 2)}{label}" for key, label in _ANCHORS if t.get(key) is not None), "n/a")
    return [t["kernel"], t["shape"], _fmt(t["ms"], 3), rate, of_ceiling, anchor]


def _sweep_row(s: dict[str, Any]) -> list[str]:
    config = " ".join(f"{key}={s[key]}" for key in s if key.isupper() or key[:4] in ("num_", "min_"))
    return [s["kernel"], s["shape"], config, _fmt(s["ms"], 3), _fmt(s.get("GBps") or s.get("TFLOPs"))]


def print_summary(report: Report) -> None:
    """The sweep, the checks, then the headline table last (the end of the output is what a
    device run returns)."""
    if report.sweeps:
        print("\nTile sweep. The heuristics pick, at these shapes: decode BLOCK_N=64 warps=4 stages=2 "
              "min_split=256; extend 128/64 warps=8 stages=3; fp8 M=16: 16/64/128 (N=28672), 16/32/256 "
              "(N=4096); M=4096: 128/128/64 warps=8 stages=4; mla_decode (128 heads): 64/16 warps=8 stages=3 "
              "min_split=2048")  # fmt: skip
        print_table(["kernel", "shape", "config", "ms", "GB/s or TFLOP/s"], [_sweep_row(s) for s in report.sweeps])
    failed = [c for c in report.checks if not c["ok"]]
    print(f"\nChecks: {len(report.checks) - len(failed)}/{len(report.checks)} passed")
    for c in failed:
        print(f"  FAILED {c['name']}: {c['rel_err']:.2e} > {c['tolerance']:.0e}")
    for e in report.errors:
        print(f"  ERROR {e.splitlines()[0]}")
    c = report.ceilings
    print(f"\n{report.device} | torch {report.versions.get('torch')} triton {report.versions.get('triton')} | "
          f"ceilings: copy {_fmt(c.get('copy_GBps'), 0)} GB/s, "
          f"bf16 matmul {_fmt(c.get('matmul_bf16_TFLOPs'), 0)} TFLOP/s")  # fmt: skip
    print_table(["kernel", "shape", "ms", "rate", "of ceiling", "vs anchor"], [_timing_row(t) for t in report.timings])


def write_json(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--json", type=Path, help="where to write the results (default: $OUT, else bench/results)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-configuration sweep")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop starting sweep variants after this many seconds (default 420: one 8-minute run)",
    )
    parser.add_argument("--checks-only", action="store_true", help="correctness only, no timings")
    parser.add_argument(
        "--dry-run", action="store_true", help="on the CPU in Triton's interpreter (TRITON_INTERPRET=1), tiny shapes"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("kernels_gpu: --dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1",
                  file=sys.stderr)  # fmt: skip
            return 2
        dry_run_sizes()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print("kernels_gpu: TRITON_INTERPRET=1 would interpret the kernels on the CPU; unset it", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "kernels_gpu: no CUDA device here. This script checks and times the Triton kernels on a GPU: run "
            "bench/kernels_gpu.sh on a CUDA machine (the CPU checks are pytest tests/kernels).",
            file=sys.stderr,
        )
        return 2
    import triton

    import kernels.triton as triton_kernels

    k = argparse.Namespace(**triton_kernels.KERNELS)
    device = "cpu (dry run: Triton interpreter, float16 for bfloat16)" if args.dry_run else torch.cuda.get_device_name()
    report = Report(device=device, versions={"torch": torch.__version__,
                                                                   "triton": triton.__version__})  # fmt: skip
    print(f"{report.device}: torch {torch.__version__}, triton {triton.__version__}")
    guarded(report, "ceilings", lambda: measure_ceilings(report))
    guarded(report, "correctness: elementwise kernels", lambda: check_elementwise(report, k))
    guarded(report, "correctness: attention", lambda: check_attention(report, k))
    guarded(report, "correctness: sliding-window attention", lambda: check_sliding_window(report, k))
    guarded(report, "correctness: batch invariance", lambda: check_batch_invariance(report, k))
    guarded(report, "correctness: fp8 and int8 weights", lambda: check_8bit_weights(report, k))
    guarded(report, "correctness: LoRA", lambda: check_lora(report, k))
    guarded(report, "correctness: MoE experts", lambda: check_moe(report, k))
    guarded(report, "correctness: MLA decode", lambda: check_mla(report, k))
    if not args.checks_only and report.ceilings:
        guarded(report, "timing: decode attention", lambda: time_decode(report, k))
        guarded(report, "timing: MLA decode", lambda: time_mla(report, k))
        guarded(report, "timing: prefill/extend attention", lambda: time_extend(report, k))
        guarded(report, "timing: fp8 and invariant matmul", lambda: time_fp8(report, k))
        guarded(report, "timing: elementwise kernels", lambda: time_elementwise(report, k))
        guarded(report, "timing: MoE experts", lambda: time_moe(report, k))
        if not args.no_sweep and not args.dry_run:  # MLA's first: its tiles were never timed yet
            guarded(report, "sweep: MLA decode", lambda: sweep_mla(report, k, started + args.budget_s))
            guarded(report, "sweep", lambda: sweep_attention(report, k, started + args.budget_s))
    write_json(report, args.json or default_json_path(os.environ))
    print_summary(report)
    print(f"\n{'PASSED' if report.passed else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
