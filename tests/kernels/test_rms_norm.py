"""RMSNorm and fused residual-add + RMSNorm against the reference, in the interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from kernels.triton.testing import poisoned_allocations, relative_error

# Same-dtype references: the kernels round where the reference rounds, so fp16 differs
# only by the odd last-bit flip from a different summation order.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}
EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 100), (33, 1536)])
def test_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = torch.randn(tokens, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    with poisoned_allocations():
        out = rms_norm(x, weight, EPS)
    assert relative_error(out, reference.rms_norm(x, weight, EPS)) < TOLERANCE[dtype]


def test_rms_norm_over_heads_of_a_fused_projection() -> None:
    """q/k-norm: rows are heads read in place out of the fused qkv output (strided, not contiguous)."""
    tokens, heads, head_dim = 9, 4, 64
    qkv = torch.randn(tokens, (heads + 2) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = torch.randn(head_dim)
    with poisoned_allocations():
        out = rms_norm(q, weight, EPS)
    assert out.shape == q.shape
    assert relative_error(out, reference.rms_norm(q, weight, EPS)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (13, 200)])
def test_fused_add_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, residual = torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    with poisoned_allocations():
        out, summed = fused_add_rms_norm(x, residual, weight, EPS)
    ref_out, ref_summed = reference.fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, ref_summed)
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
