"""MLA decode (every head over the one latent row a token, values its first v_dim columns) against
``reference.mla_decode_attention`` in the interpreter, and a sequence's bits alone vs in a batch."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import reference
from kernels.triton.mla_decode import mla_decode_attention
from kernels.triton.testing import poisoned_allocations, relative_error
from tests.kernels.paged import random_paged_kv

# Autouse there and, imported, here: the interpreter's bfloat16 dots and casts as a GPU computes them.
from tests.kernels.test_fused_moe import bfloat16_as_on_a_gpu  # noqa: F401

# float32 is exact float32 in the interpreter; 16-bit adds the rounding of the probabilities before
# P @ V and of the output (measured: float16 under 3e-4, bfloat16 under 2.2e-3).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One token, part of a block, one block, a block and one, two splits (20 heads: splits of at least 320
# tokens): none but 16 fills its last block.
EDGE_LENS = [1, 5, 16, 17, 350]


def _check(dtype: torch.dtype, heads: int, head_dim: int, v_dim: int, lens: list[int]) -> None:
    kv = random_paged_kv(lens, 1, head_dim, dtype)  # slots no sequence owns hold 1e4: reading one shows
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    with poisoned_allocations():  # an output element never written is NaN
        out = mla_decode_attention(q, kv.k_cache, kv.block_tables, kv.seq_lens, scale, v_dim)
    ref = reference.mla_decode_attention(q.float(), kv.k_cache.float(), kv.block_tables, kv.seq_lens, scale, v_dim)
    assert out.shape == (len(lens), heads, v_dim) and out.dtype == dtype and out.is_contiguous()
    assert relative_error(out, ref) < TOLERANCE[dtype], f"seq_lens {lens}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_matches_reference(dtype: torch.dtype) -> None:
    """A small latent (40 value columns + 8 key-only ones, neither a power of 2) and 20 heads: a head
    block of 32 (16-bit) or 16 (float32), the last one partial."""
    lens = EDGE_LENS + [random.randint(2, 200)]
    random.shuffle(lens)
    _check(dtype, 20, 48, 40, lens)


def test_deepseek_v3_width() -> None:
    """DeepSeek-V3's row (512 latent values + 64 rotary) in bfloat16; 72 heads: two blocks of 64, the
    second mostly padding (one split each: splits of 72 heads are at least 1152 tokens)."""
    _check(torch.bfloat16, 72, 576, 512, [1, 33, 260])


def test_every_column_a_value() -> None:
    """v_dim = D: no key-only columns (their dot runs over masked zeros)."""
    _check(torch.float32, 3, 32, 32, [7, 20])


def test_int64_metadata_and_strided_query() -> None:
    """int64 tables and lengths, and q a view with padded head strides."""
    kv = random_paged_kv([33, 300], 1, 48, torch.float32)
    q = torch.randn(2, 5, 64)[:, :, :48]
    out = mla_decode_attention(q, kv.k_cache, kv.block_tables.long(), kv.seq_lens.long(), 0.125, 40)
    ref = reference.mla_decode_attention(q, kv.k_cache, kv.block_tables, kv.seq_lens, 0.125, 40)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda d: str(d)[6:])
def test_a_sequence_alone_and_in_a_batch_give_the_same_bits(dtype: torch.dtype) -> None:
    """The splits follow the sequence's own length: alone (a narrower block table, so a smaller grid)
    its output is bitwise what it gets beside others."""
    lens, at = [5, 700, 40], 1  # 700: three splits of at least 320 tokens
    kv = random_paged_kv(lens, 1, 48, dtype)
    q = torch.randn(len(lens), 20, 48).to(dtype)
    batched = mla_decode_attention(q, kv.k_cache, kv.block_tables, kv.seq_lens, 0.125, 40)
    table = kv.block_tables[at : at + 1, : -(-lens[at] // 16)]
    alone = mla_decode_attention(q[at : at + 1], kv.k_cache, table, kv.seq_lens[at : at + 1], 0.125, 40)
    assert torch.equal(alone[0], batched[at])


def test_rejects_what_it_cannot_run() -> None:
    q, cache = torch.randn(2, 4, 48), torch.zeros(4, 16, 1, 48)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([3, 9], dtype=torch.int32)
    for v_dim in (0, 49, 40.0):
        with pytest.raises(ValueError, match="v_dim"):
            mla_decode_attention(q, cache, tables, lens, 0.1, v_dim)
    with pytest.raises(ValueError, match="one row a token"):
        mla_decode_attention(q, torch.zeros(4, 16, 2, 48), tables, lens, 0.1, 40)
    with pytest.raises(ValueError, match="width"):
        mla_decode_attention(q, torch.zeros(4, 16, 1, 64), tables, lens, 0.1, 40)
    with pytest.raises(ValueError, match="dtype"):
        mla_decode_attention(q.half(), cache, tables, lens, 0.1, 40)
