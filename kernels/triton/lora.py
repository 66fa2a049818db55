"""The segmented LoRA product: each run of tokens that share an adapter times that adapter's factors.

Same contract as ``kernels.reference.lora_add``. One program per (segment, output tile): it walks
its segment's tokens ``BLOCK_M`` at a time, shrinks them onto the slot's rank columns (``x @ A``,
accumulated over the input in ``BLOCK_K`` steps and rounded to the storage dtype, as the
reference's first product is), expands that tile (``@ B``) and adds it into its output columns. The
shrink is recomputed per output tile: it is rank-wide, a small fraction of the expand. Segments never
overlap, so every output element is read and written by one program; rows of tokens outside every
segment (no adapter) are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraSegments
from kernels.triton._validate import check_same_device, check_tensor, require


@triton.jit
def _lora_add_kernel(
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
    stride_a_slot,
    stride_a_rank,
    stride_b_slot,
    stride_b_rank,
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
        b_ptr + slot * stride_b_slot + r[:, None] * stride_b_rank + n[None, :],
        mask=r_ok[:, None] & n_ok[None, :],
        other=0.0,
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
            a_tile = tl.load(  # A^T's tile [BLOCK_K, RANK]: A is stored [rank, in]
                a_ptr + slot * stride_a_slot + r[None, :] * stride_a_rank + k[:, None],
                mask=k_ok[:, None] & r_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            shrunk += tl.dot(x_tile, a_tile)
        shrunk = shrunk.to(out_ptr.dtype.element_ty).to(tl.float32)
        out_ptrs = out_ptr + rows[:, None] * stride_out + n[None, :]
        tile_ok = m_ok[:, None] & n_ok[None, :]
        # Rounded to the storage dtype before the add, as the reference's product is.
        delta = tl.dot(shrunk, b_tile).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = tl.load(out_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (y + delta).to(out_ptr.dtype.element_ty), mask=tile_ok)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments) -> None:
    check_tensor("y", y, 2)
    check_tensor("x", x, 2)
    check_tensor("a", a, 3)
    check_tensor("b", b, 3)
    check_same_device(y=y, x=x, a=a, b=b, token_slots=segments.token_slots)
    require(a.shape[2] == x.shape[1], f"a {tuple(a.shape)} must be [slots, width, {x.shape[1]}] for x's inputs")
    require(a.shape[:2] == b.shape[:2], f"a {tuple(a.shape)} and b {tuple(b.shape)} must share slots and width")
    require(a.shape[0] >= segments.num_slots, f"a {tuple(a.shape)} holds fewer than {segments.num_slots} slots")
    require(y.shape == (x.shape[0], b.shape[2]), f"y {tuple(y.shape)} must be [{x.shape[0]}, {b.shape[2]}]")
    dtypes = (y.dtype, x.dtype, a.dtype, b.dtype)
    require(len(set(dtypes)) == 1, f"y, x, a, b must share a dtype, got {', '.join(map(str, dtypes))}")
    width, n_out, n_seg = a.shape[1], b.shape[2], segments.seg_slot.numel()
    if n_seg and n_out:
        block_n = min(triton.next_power_of_2(n_out), 64)
        grid = (n_seg, triton.cdiv(n_out, block_n))
        _lora_add_kernel[grid](
            x,
            a,
            b,
            y,
            segments.seg_start,
            segments.seg_len,
            segments.seg_slot,
            x.shape[1],
            n_out,
            x.stride(0),
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            y.stride(0),
            RANK=width,
            RANK_P2=max(16, triton.next_power_of_2(width)),
            BLOCK_M=16,
            BLOCK_K=64,
            BLOCK_N=block_n,
            num_warps=4,
        )
