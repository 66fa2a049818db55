"""KV-cache write against the reference, in the interpreter: exact copies into the right
slots, nothing written for padding slots (-1) or anywhere else."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.kv_write import write_kv_cache

NUM_BLOCKS, BLOCK_SIZE = 12, 16


def _nan_caches(heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                    (torch.float32, torch.float16)])  # fmt: skip
@pytest.mark.parametrize("heads,head_dim", [(1, 64), (4, 128), (3, 80)])
def test_matches_reference(src_dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, head_dim: int) -> None:
    tokens = 40
    # Fused-projection views: k and v are strided slices of one [T, ...] tensor.
    kv = torch.randn(tokens, 2 * heads * head_dim + 8).to(src_dtype)
    k = kv[:, : heads * head_dim].view(tokens, heads, head_dim)
    v = kv[:, heads * head_dim : 2 * heads * head_dim].view(tokens, heads, head_dim)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:tokens]
    slots[torch.randperm(tokens)[:7]] = -1  # padding

    k_cache, v_cache = _nan_caches(heads, head_dim, cache_dtype)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = _nan_caches(heads, head_dim, cache_dtype)
    reference.write_kv_cache(k, v, k_ref, v_ref, slots)

    # equal_nan: every slot the reference leaves unwritten must still be NaN here.
    assert torch.allclose(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    assert (~torch.isnan(k_cache)).sum() == (slots >= 0).sum() * heads * head_dim


def test_all_padding_writes_nothing() -> None:
    k = torch.randn(5, 2, 64)
    k_cache, v_cache = _nan_caches(2, 64, torch.float32)
    write_kv_cache(k, k, k_cache, v_cache, torch.full((5,), -1, dtype=torch.int64))
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()
