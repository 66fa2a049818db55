"""Paged prefill/extend attention against the reference, in the interpreter."""

from __future__ import annotations

import random

import pytest
import torch

import kernels.triton
from kernels import reference
from kernels.triton.extend_attention import paged_extend_attention
from kernels.triton.testing import poisoned_allocations, relative_error
from tests.kernels.paged import dense_attention, poison_keys, random_paged_kv

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


# Sliding windows: none, each row alone, a few keys, a window crossing a block edge, one whose 128-row
# query tiles have keys masked at the window's start, unmasked keys in every row's window and the
# diagonal (300 over the 300-token prefix), and one longer than any sequence.
WINDOWS = [0, 1, 5, 17, 300, 5000]
# (cached prefix, new tokens): a prefill over two query tiles, a one-token extend, new tokens over a
# long prefix (several key tiles, a ragged query tile), a short prefill.
WINDOW_CASES = [(0, 130), (77, 1), (300, 200), (0, 3)]


def _windowed_case(
    dtype: torch.dtype, window: int, cases: list[tuple[int, int]] = WINDOW_CASES
) -> tuple[torch.Tensor, object, torch.Tensor, torch.Tensor]:
    """Inputs, the query_start_loc and the dense masked reference; then the keys before each sequence's
    first window (its first new token's) hold NaN: no tile may read them."""
    prefixes, news = (list(x) for x in zip(*cases))
    kv = random_paged_kv([p + n for p, n in cases], 2, 64, dtype)
    qsl = _query_start_loc(news)
    q = torch.randn(sum(news), 8, 64).to(dtype)
    ref = torch.cat([
        dense_attention(q[qsl[i] : qsl[i + 1]], kv, i, list(range(p, p + n)), 0.125, window)
        for i, (p, n) in enumerate(cases)
    ])  # fmt: skip
    if window:
        for i, p in enumerate(prefixes):
            poison_keys(kv, i, max(0, p - window + 1))
    return q, kv, qsl, ref


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_matches_masked_softmax(window: int) -> None:
    q, kv, qsl, ref = _windowed_case(torch.float32, window)
    with poisoned_allocations():
        out = paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, 0.125, window)
    assert relative_error(out, ref) < TOLERANCE[torch.float32], f"window {window}"


def test_sliding_window_float16() -> None:
    q, kv, qsl, ref = _windowed_case(torch.float16, 17)
    out = paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, 0.125, 17)
    assert out.dtype == torch.float16 and relative_error(out, ref) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("window", [5, 17])
def test_sliding_window_every_row_as_decode(window: int) -> None:
    """Deterministic serving's extend (each row a Triton decode, through kernels.rows_as_decodes)
    passes the window on to the decode kernel. Few rows: each is a decode of its own in the interpreter."""
    every_row = kernels.triton.INVARIANT_KERNELS["paged_extend_attention"]
    q, kv, qsl, ref = _windowed_case(torch.float32, window, [(40, 12), (0, 6)])
    with poisoned_allocations():
        out = every_row(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, 0.125, window)
    assert relative_error(out, ref) < TOLERANCE[torch.float32], f"window {window}"
