"""Neox-style rotary embedding of q and k, one program per token.

The RoPE scaling of the model (linear, llama3, yarn) lives in ``cos_sin_cache``
[max_pos, head_dim] (cos half | sin half), so the kernel only rotates: each head's
first half x1 and second half x2 become (x1·cos − x2·sin, x2·cos + x1·sin).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._validate import INDEX_DTYPES, check_same_device, check_tensor, require


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_t, stride_h, n_heads, cos, sin, half, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < n_heads) & (cols[None, :] < half)
    src = x_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * n_heads * 2 * half + heads[:, None] * 2 * half + cols[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    n_q_heads,
    n_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + half + cols, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, n_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, n_k_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (any token/head strides); positions [T]; returns new contiguous q, k."""
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_tensor("q", q, 3)
    check_tensor("k", k, 3)
    check_tensor("cos_sin_cache", cos_sin_cache, 2)
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    t, hq, d = q.shape
    require(k.shape[0] == t and k.shape[2] == d, f"k shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    require(k.dtype == q.dtype, f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    require(positions.shape[0] == t, f"positions has {positions.shape[0]} entries for {t} tokens")
    require(d % 2 == 0, f"head_dim must be even, got {d}")
    require(cos_sin_cache.shape[1] == d, f"cos_sin_cache rows have {cos_sin_cache.shape[1]} values, head_dim is {d}")

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    hk, half = k.shape[1], d // 2
    block_hq, block_hk, block_half = (triton.next_power_of_2(n) for n in (hq, hk, half))
    _rotary_kernel[(t,)](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        hq, hk, half,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, num_warps=4,
    )  # fmt: skip
    return q_out, k_out
