"""The CPU reference's extend attention over a speculative verify's few rows per sequence
is bitwise what decode attention gives each row at its own position: a verify rounds as the
decodes it stands for, so greedy speculation decodes exactly what plain decoding does
(in bf16 too, where a masked call over several query rows rounds otherwise)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.paged import random_paged_kv

NUM_KV_HEADS, GROUP, HEAD_DIM, SCALE = 3, 3, 64, 0.125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_verify_row_attends_as_its_decode(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    new = [5, 1, 3, reference.DECODE_ROWS_MAX]  # verifies of 4 and 2 drafts, a decode, the longest short one
    prefix = [37, 80, 16, 5]
    kv = random_paged_kv([p + n for p, n in zip(prefix, new)], NUM_KV_HEADS, HEAD_DIM, dtype)
    starts = [0] + torch.tensor(new).cumsum(0).tolist()
    q = torch.randn(starts[-1], NUM_KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    got = reference.paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                           torch.tensor(starts), kv.seq_lens, SCALE)
    for i, (p, n) in enumerate(zip(prefix, new)):
        for j in range(n):
            row = starts[i] + j
            # The decode of this token: its sequence alone, seeing its prefix and itself.
            want = reference.paged_decode_attention(q[row : row + 1], kv.k_cache, kv.v_cache,
                                                    kv.block_tables[i : i + 1], torch.tensor([p + j + 1]), SCALE)
            assert torch.equal(got[row], want[0]), f"sequence {i}, row {j}"


def test_a_prefill_chunk_still_attends_causally() -> None:
    """Longer runs of new tokens take the one masked call; it agrees with row by row."""
    torch.manual_seed(1)
    n, p = reference.DECODE_ROWS_MAX + 9, 20
    kv = random_paged_kv([p + n], NUM_KV_HEADS, HEAD_DIM, torch.float32)
    q = torch.randn(n, NUM_KV_HEADS * GROUP, HEAD_DIM)
    got = reference.paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([0, n]),
                                           kv.seq_lens, SCALE)
    rows = torch.cat([reference.paged_decode_attention(q[j : j + 1], kv.k_cache, kv.v_cache, kv.block_tables,
                                                       torch.tensor([p + j + 1]), SCALE) for j in range(n)])
    torch.testing.assert_close(got, rows, rtol=1e-5, atol=1e-5)
