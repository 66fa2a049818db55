"""Paged prefill/extend attention against the reference, in the interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import reference
from kernels.triton.extend_attention import paged_extend_attention
from kernels.triton.testing import poisoned_allocations, relative_error
from tests.kernels.paged import random_paged_kv

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# GQA ratios 1/4/8 × head dims 64/128 in fp32; fp16 (slow in the interpreter's numpy
# matmul) on a subset that still covers each ratio and each head dim.
VARIANTS = [(torch.float32, hk, g, d) for hk, g in [(4, 1), (2, 4), (1, 8)] for d in (64, 128)] + [
    (torch.float16, 4, 1, 128),
    (torch.float16, 2, 4, 64),
    (torch.float16, 1, 8, 64),
]
# (cached prefix, new tokens): a plain prefill longer than one 128-row query tile, a
# one-token extend over a prefix, new tokens exactly one key tile, a long prefix with a
# ragged tile of new tokens, and a prefill shorter than one key tile.
EDGE_CASES = [(0, 130), (77, 1), (5, 64), (300, 200), (0, 3)]


def _query_start_loc(new_tokens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int32)


def run_and_reference(
    prefixes: list[int], new_tokens: list[int], num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    kv = random_paged_kv([p + n for p, n in zip(prefixes, new_tokens)], num_kv_heads, head_dim, dtype)
    qsl = _query_start_loc(new_tokens)
    q = torch.randn(sum(new_tokens), num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    with poisoned_allocations():
        out = paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, scale)
    ref = reference.paged_extend_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, qsl, kv.seq_lens, scale
    )
    return out, ref


@pytest.mark.parametrize(
    "dtype,num_kv_heads,group,head_dim", VARIANTS, ids=[f"{str(v[0])[6:]}-Hk{v[1]}-G{v[2]}-D{v[3]}" for v in VARIANTS]
)
def test_matches_reference(dtype: torch.dtype, head_dim: int, num_kv_heads: int, group: int) -> None:
    cases = EDGE_CASES + [(random.randint(0, 150), random.randint(1, 150))]
    random.shuffle(cases)
    prefixes, new_tokens = (list(x) for x in zip(*cases))
    out, ref = run_and_reference(prefixes, new_tokens, num_kv_heads, group, head_dim, dtype)
    assert out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype], f"cases {cases}"


def test_single_sequence() -> None:
    """One sequence: the program-to-sequence search has nothing to search."""
    out, ref = run_and_reference([40], [100], 2, 2, 64, torch.float32)
    assert relative_error(out, ref) < 1e-5
