"""Neox rotary embedding against the reference, in the interpreter, with a scaled RoPE table."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.rotary import rotary_embedding
from kernels.triton.testing import poisoned_allocations, relative_error
from kvmesh.engine.rope import rope_cos_sin_cache

TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
MAX_POS = 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_heads,k_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 1, 96)])
def test_matches_reference_on_fused_qkv_views(dtype: torch.dtype, q_heads: int, k_heads: int, head_dim: int) -> None:
    tokens = 11
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(tokens, k_heads, head_dim)
    positions = torch.randint(0, MAX_POS, (tokens,))
    cache = rope_cos_sin_cache(LLAMA3_ROPE, head_dim, MAX_POS, MAX_POS)

    with poisoned_allocations():
        q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache)

    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert relative_error(q_out, q_ref) < TOLERANCE[dtype]
    assert relative_error(k_out, k_ref) < TOLERANCE[dtype]
