"""KV-cache write: new k/v [T, Hk, D] into the paged caches at flat slots; slot -1 is padding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._validate import INDEX_DTYPES, check_same_device, check_tensor, require


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    n_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    # A padding slot has no heads to copy: every access is masked, nothing read or written.
    heads_to_copy = tl.where(slot >= 0, n_heads, 0)
    mask = (heads < heads_to_copy) & (cols < head_dim)
    dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_token
    dst += heads * stride_cache_head + cols
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + cols, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + cols, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k/v [T, Hk, D] (any token/head strides); caches [num_blocks, block_size, Hk, D] sharing one layout."""
    check_tensor("k", k, 3)
    check_tensor("v", v, 3)
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    t, hk, d = k.shape
    require(v.shape == k.shape, f"v shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    require(
        k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
        f"k_cache {tuple(k_cache.shape)}/{k_cache.stride()} and v_cache {tuple(v_cache.shape)}/{v_cache.stride()}"
        " must share shape and strides",
    )
    require(tuple(k_cache.shape[2:]) == (hk, d), f"cache heads/dim {tuple(k_cache.shape[2:])}, k has {(hk, d)}")
    require(slot_mapping.shape[0] == t, f"slot_mapping has {slot_mapping.shape[0]} entries for {t} tokens")
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hk, d,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )  # fmt: skip
