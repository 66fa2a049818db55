"""A sequence's attention output is bitwise the same alone as in a batch of 37: no
tiling, split or reduction order may depend on the other sequences."""

from __future__ import annotations

import random

import torch

from kernels.triton.decode_attention import paged_decode_attention
from kernels.triton.extend_attention import paged_extend_attention
from tests.kernels.paged import random_paged_kv

BATCH = 37
POSITION = 17  # where the watched sequence sits in the batch
NUM_KV_HEADS, GROUP, HEAD_DIM = 1, 4, 64


def test_decode_alone_equals_in_batch() -> None:
    seq_lens = [random.randint(1, 300) for _ in range(BATCH)]
    seq_lens[POSITION] = 700  # several splits
    kv = random_paged_kv(seq_lens, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    q = torch.randn(BATCH, NUM_KV_HEADS * GROUP, HEAD_DIM)
    batched = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)

    alone_table = kv.block_tables[POSITION : POSITION + 1, : -(-700 // 16)]  # a narrower table, too
    alone = paged_decode_attention(
        q[POSITION : POSITION + 1], kv.k_cache, kv.v_cache, alone_table, kv.seq_lens[POSITION : POSITION + 1], 0.125
    )
    assert torch.equal(alone[0], batched[POSITION])


def test_extend_alone_equals_in_batch() -> None:
    prefixes = [random.randint(0, 60) for _ in range(BATCH)]
    new_tokens = [random.randint(1, 20) for _ in range(BATCH)]
    prefixes[POSITION], new_tokens[POSITION] = 150, 140  # more than one query tile
    kv = random_paged_kv([p + n for p, n in zip(prefixes, new_tokens)], NUM_KV_HEADS, HEAD_DIM, torch.float32)
    starts = [0] + torch.tensor(new_tokens).cumsum(0).tolist()
    q = torch.randn(starts[-1], NUM_KV_HEADS * GROUP, HEAD_DIM)
    qsl = torch.tensor(starts, dtype=torch.int32)
    batched = paged_extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, 0.125)

    a, b = starts[POSITION], starts[POSITION + 1]
    alone = paged_extend_attention(
        q[a:b],
        kv.k_cache,
        kv.v_cache,
        kv.block_tables[POSITION : POSITION + 1],
        torch.tensor([0, b - a], dtype=torch.int32),
        kv.seq_lens[POSITION : POSITION + 1],
        0.125,
    )
    assert torch.equal(alone, batched[a:b])
