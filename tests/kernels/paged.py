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
