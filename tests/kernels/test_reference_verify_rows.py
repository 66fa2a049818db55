"""The CPU reference's extend attention over a speculative verify's few rows per sequence,
in bf16, is bitwise what decode attention gives each row at its own position: a verify
rounds as the decodes it stands for, so greedy speculation decodes exactly what plain
decoding does (a masked call over several query rows rounds otherwise). float32 keeps the
one call, equal to the decodes within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.paged import random_paged_kv

NUM_KV_HEADS, GROUP, HEAD_DIM, SCALE = 3, 3, 64, 0.125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_verify_row_attends_as_its_decode(dtype: torch.dtype) -> None:
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    # Verifies of 4 and 2 drafts, a decode, the longest short run, more verifies: in bf16 one
    # masked call over each sequence's rows gives 2 of these 45 rows other bits (seed 0).
    new = [5, 1, 3, reference.DECODE_ROWS_MAX, 5, 5, 5, 5]
    prefix = [37, 80, 16, 5, 100, 60, 20, 7]
    kv = random_paged_kv([p + n for p, n in zip(prefix, new)], NUM_KV_HEADS, HEAD_DIM, dtype)
    starts = [0] + torch.tensor(new).cumsum(0).tolist()
    q = torch.randn(starts[-1], NUM_KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    got = reference.paged_extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor(starts), kv.seq_lens, SCALE
    )
    for i, (p, n) in enumerate(zip(prefix, new)):
        for j in range(n):
            row = starts[i] + j
            # The decode of this token: its sequence alone, seeing its prefix and itself.
            want = reference.paged_decode_attention(
                q[row : row + 1], kv.k_cache, kv.v_cache, kv.block_tables[i : i + 1], torch.tensor([p + j + 1]), SCALE
            )
            assert same(got[row], want[0]), f"sequence {i}, row {j}"


def test_a_prefill_chunk_still_attends_causally() -> None:
    """Longer runs of new tokens take the one masked call; it agrees with row by row."""
    torch.manual_seed(1)
    n, p = reference.DECODE_ROWS_MAX + 9, 20
    kv = random_paged_kv([p + n], NUM_KV_HEADS, HEAD_DIM, torch.float32)
    q = torch.randn(n, NUM_KV_HEADS * GROUP, HEAD_DIM)
    got = reference.paged_extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([0, n]), kv.seq_lens, SCALE
    )
    rows = torch.cat(
        [
            reference.paged_decode_attention(
                q[j : j + 1], kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([p + j + 1]), SCALE
            )
            for j in range(n)
        ]
    )
    torch.testing.assert_close(got, rows, rtol=1e-5, atol=1e-5)
