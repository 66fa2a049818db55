"""Random paged KV caches for the attention tests: each sequence's blocks are scattered
over a shuffled pool, and every cache slot no sequence owns holds a large value, so a
kernel that reads past a sequence's end or through a wrong block shows a large error."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
UNOWNED = 1.0e4


@dataclass
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def random_paged_kv(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, spare_blocks: int = 5
) -> PagedKV:
    blocks_needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, UNOWNED, dtype=dtype)
    v_cache = torch.full(shape, UNOWNED, dtype=dtype)
    pool = torch.randperm(num_blocks).tolist()
    # Wider than any sequence needs: the padding entries must never be read.
    tables = torch.zeros((len(seq_lens), max(blocks_needed, default=0) + 2), dtype=torch.int32)
    for i, (n, blocks) in enumerate(zip(seq_lens, blocks_needed)):
        mine, pool = pool[:blocks], pool[blocks:]
        tables[i, :blocks] = torch.tensor(mine, dtype=torch.int32)
        for t in range(0, n, BLOCK_SIZE):
            rows = min(BLOCK_SIZE, n - t)
            block = mine[t // BLOCK_SIZE]
            k_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim).to(dtype)
            v_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim).to(dtype)
    return PagedKV(k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32))


def dense_attention(
    q: torch.Tensor,
    kv: PagedKV,
    seq: int,
    positions: list[int],
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Plain masked softmax in float64, independent of ``kernels.reference``: queries q [n, Hq, D]
    at ``positions`` of sequence ``seq``, each over the keys at k <= p and, with a window W > 0,
    k > p - W (transformers' sliding window). Returns [n, Hq, D] in float64."""
    seq_len = int(kv.seq_lens[seq])
    blocks = kv.block_tables[seq, : -(-seq_len // BLOCK_SIZE)].long()
    k = kv.k_cache[blocks].flatten(0, 1)[:seq_len].double()  # [S, Hk, D]
    v = kv.v_cache[blocks].flatten(0, 1)[:seq_len].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), k) * scale
    keys, pos = torch.arange(seq_len)[None, :], torch.tensor(positions)[:, None]
    visible = keys <= pos
    if window:
        visible &= keys > pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnk,khd->nhd", probs, v)


def poison_keys(kv: PagedKV, seq: int, end: int) -> None:
    """NaN in sequence ``seq``'s K and V at positions [0, end): a kernel that reads any of them,
    even to mask it, returns NaN there."""
    for t in range(end):
        block = int(kv.block_tables[seq, t // BLOCK_SIZE])
        kv.k_cache[block, t % BLOCK_SIZE] = float("nan")
        kv.v_cache[block, t % BLOCK_SIZE] = float("nan")
