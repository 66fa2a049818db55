"""Paged decode attention (split-KV flash-decoding) against the reference, in the interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import reference
from kernels.triton.decode_attention import paged_decode_attention
from kernels.triton.testing import poisoned_allocations, relative_error
from tests.kernels.paged import dense_attention, poison_keys, random_paged_kv

# fp32 math in the interpreter is exact float32; fp16 adds the rounding of the
# probabilities before the P·V product and of the output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# GQA ratios 1/4/8 × head dims 64/128 in fp32; fp16 (slow in the interpreter's numpy
# matmul) on a subset that still covers each ratio and each head dim.
VARIANTS = [(torch.float32, hk, g, d) for hk, g in [(4, 1), (2, 4), (1, 8)] for d in (64, 128)] + [
    (torch.float16, 4, 1, 128),
    (torch.float16, 2, 4, 64),
    (torch.float16, 1, 8, 64),
]
# Edge lengths: one token, one block, one key tile, one split (256) and a split + 1,
# lengths cut into several splits whose last one is ragged.
EDGE_LENS = [1, 16, 64, 256, 257, 1100]


@pytest.mark.parametrize(
    "dtype,num_kv_heads,group,head_dim", VARIANTS, ids=[f"{str(v[0])[6:]}-Hk{v[1]}-G{v[2]}-D{v[3]}" for v in VARIANTS]
)
def test_matches_reference(dtype: torch.dtype, head_dim: int, num_kv_heads: int, group: int) -> None:
    seq_lens = EDGE_LENS + [random.randint(2, 900) for _ in range(2)]
    random.shuffle(seq_lens)
    kv = random_paged_kv(seq_lens, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5

    with poisoned_allocations():
        out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    ref = reference.paged_decode_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.seq_lens, scale
    )

    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype], f"seq_lens {seq_lens}"


def test_int64_metadata_and_strided_query() -> None:
    """The engine passes int64 tables and lengths; q may be a view with padded head strides."""
    seq_lens = [33, 300]
    kv = random_paged_kv(seq_lens, 2, 64, torch.float32)
    q = torch.randn(2, 8, 80)[:, :, :64]
    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens.long(), 0.125)
    ref = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    assert relative_error(out, ref) < 1e-5


# Sliding windows: none, the query alone, a few keys, a window crossing a block edge, one spanning
# several decode splits (600 keys: three splits of 256), and one longer than any sequence.
WINDOWS = [0, 1, 5, 17, 600, 5000]
# One token, one block, a key tile and a bit, two splits, five splits (1100: full attention's count).
WINDOW_LENS = [1, 16, 70, 300, 1100]


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_matches_masked_softmax(window: int) -> None:
    """Against a dense masked softmax computed here; the keys before the window hold NaN, so reading
    any of them (the kernel starts at max(0, seq_len - window)) shows."""
    num_kv_heads, group, head_dim, scale = 2, 4, 64, 0.125
    kv = random_paged_kv(WINDOW_LENS, num_kv_heads, head_dim, torch.float32)
    q = torch.randn(len(WINDOW_LENS), num_kv_heads * group, head_dim)
    ref = torch.cat([dense_attention(q[i : i + 1], kv, i, [n - 1], scale, window) for i, n in enumerate(WINDOW_LENS)])
    if window:
        for i, n in enumerate(WINDOW_LENS):
            poison_keys(kv, i, max(0, n - window))

    with poisoned_allocations():
        out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, window)

    assert relative_error(out, ref) < TOLERANCE[torch.float32], f"window {window}"


def test_sliding_window_float16_and_gqa8() -> None:
    lens, window, scale = [40, 513], 300, 64**-0.5
    kv = random_paged_kv(lens, 1, 64, torch.float16)
    q = torch.randn(len(lens), 8, 64).half()
    ref = torch.cat([dense_attention(q[i : i + 1], kv, i, [n - 1], scale, window) for i, n in enumerate(lens)])
    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, window)
    assert out.dtype == torch.float16 and relative_error(out, ref) < TOLERANCE[torch.float16]


def test_sliding_window_splits_depend_on_the_sequence_alone() -> None:
    """The windowed span sizes the splits: a sequence's bits are the same alone (with a narrower
    block table, so a smaller grid) as in a batch; a window as long as the sequence is full attention."""
    lens, at, window = [5, 1100, 90, 700], 1, 600
    kv = random_paged_kv(lens, 1, 64, torch.float32)
    q = torch.randn(len(lens), 4, 64)
    batched = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, window)
    table = kv.block_tables[at : at + 1, : -(-lens[at] // 16)]
    alone = paged_decode_attention(q[at : at + 1], kv.k_cache, kv.v_cache, table, kv.seq_lens[at : at + 1], 0.125,
                                   window)  # fmt: skip
    assert torch.equal(alone[0], batched[at])
    longest = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, max(lens))
    assert torch.equal(longest, paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125))
