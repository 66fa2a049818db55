"""The segmented LoRA product: each run of tokens that share an adapter times that adapter's factors.

Same contract as ``kernels.reference.lora_delta``. One program per (segment, output tile): it walks
its segment's tokens ``BLOCK_M`` at a time, shrinks them onto the slot's rank columns (``x @ A``,
accumulated over the input in ``BLOCK_K`` steps and rounded to the storage dtype, as the
reference's first product is) and expands that tile (``@ B``) into its output columns. The shrink
is recomputed per output tile: it is rank-wide, a small fraction of the expand. Tokens outside
every segment (no adapter) keep the zeros the output starts with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraSegments
from kernels.triton._validate import check_same_device, check_tensor, require


@triton.jit
def _lora_delta_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    n_in,
    n_out,
    stride_x,
    stride_a,
    stride_b,
    stride_out,
    RANK: tl.constexpr,
    RANK_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    r = tl.arange(0, RANK_P2)
    r_ok = r < RANK
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    b_tile = tl.load(
        b_ptr + (slot * RANK + r[:, None]) * stride_b + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0
    ).to(tl.float32)
    for m0 in range(0, length, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < length
        rows = start + m
        shrunk = tl.zeros((BLOCK_M, RANK_P2), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < n_in
            x_tile = tl.load(
                x_ptr + rows[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            ).to(tl.float32)
            a_tile = tl.load(
                a_ptr + k[:, None] * stride_a + slot * RANK + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0
            ).to(tl.float32)
            shrunk += tl.dot(x_tile, a_tile)
        shrunk = shrunk.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = tl.dot(shrunk, b_tile)
        tl.store(
            out_ptr + rows[:, None] * stride_out + n[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments) -> torch.Tensor:
    check_tensor("x", x, 2)
    check_tensor("a", a, 2)
    check_tensor("b", b, 2)
    check_same_device(x=x, a=a, b=b, token_slots=segments.token_slots)
    rank = segments.rank
    require(a.shape[0] == x.shape[1], f"a {tuple(a.shape)} must have x's {x.shape[1]} input rows")
    require(a.shape[1] == b.shape[0], f"a {tuple(a.shape)} and b {tuple(b.shape)} must share the rank columns")
    require(a.shape[1] >= segments.num_slots * rank, f"a {tuple(a.shape)} holds fewer than {segments.num_slots} slots")
    require(a.dtype == x.dtype == b.dtype, f"x, a, b must share a dtype, got {x.dtype}, {a.dtype}, {b.dtype}")
    n_out = b.shape[1]
    out = torch.zeros((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    n_seg = segments.seg_slot.numel()
    if n_seg and n_out:
        block_n = min(triton.next_power_of_2(n_out), 64)
        grid = (n_seg, triton.cdiv(n_out, block_n))
        _lora_delta_kernel[grid](
            x,
            a,
            b,
            out,
            segments.seg_start,
            segments.seg_len,
            segments.seg_slot,
            x.shape[1],
            n_out,
            x.stride(0),
            a.stride(0),
            b.stride(0),
            out.stride(0),
            RANK=rank,
            RANK_P2=max(16, triton.next_power_of_2(rank)),
            BLOCK_M=16,
            BLOCK_K=64,
            BLOCK_N=block_n,
            num_warps=4,
        )
    return out
