"""Pieces the paged attention kernels share: finding a token's K/V row through the block
table, and one step of the online (flash) softmax over a tile of keys.

Scores live in the log2 domain (``qk_scale`` = softmax scale × log2 e) so the kernels use exp2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._validate import INDEX_DTYPES, check_tensor, require

LOG2_E = 1.4426950408889634


@triton.jit
def paged_row_offsets(block_table_ptr, tokens, token_mask, BLOCK_SIZE: tl.constexpr, stride_block, stride_token):
    """Offset of each token's K/V row in a paged cache, before the head and dim offsets."""
    blocks = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    return blocks * stride_block + (tokens % BLOCK_SIZE) * stride_token


@triton.jit
def attend_tile(
    acc, m_i, l_i, q, k, v, visible, qk_scale, APPLY_MASK: tl.constexpr, ROWS_MAY_BE_EMPTY: tl.constexpr = False
):
    """Fold one key tile into the running (acc, row max m_i, row sum l_i).

    q [M, D], k [D, N], v [N, D]; ``visible`` [M, N] is applied only when APPLY_MASK.
    Unless ROWS_MAY_BE_EMPTY, the caller guarantees each row has seen at least one
    visible key by its first tile, so m_i is finite after it and exp2(m_i - m_new)
    never sees inf - inf. With ROWS_MAY_BE_EMPTY (sliding windows: a row's window can
    begin tiles after the first one the program reads), a row that has seen no visible
    key yet keeps m = -inf and weighs this tile against 0 instead: all its weights are
    exp2(-inf) = 0, so acc and l_i stay 0 rather than turning NaN.
    """
    scores = tl.dot(q, k) * qk_scale
    if APPLY_MASK:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = m_new
    if ROWS_MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


def check_paged_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validates the two caches against q [.., Hq, D]; returns the GQA group size Hq // Hk."""
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    require(
        k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
        f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share shape and strides",
    )
    num_q_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k_cache.shape[2]
    require(k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} differs from q's {head_dim}")
    require(
        num_q_heads % num_kv_heads == 0,
        f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads",
    )
    require(
        k_cache.dtype == v_cache.dtype == q.dtype,
        f"q {q.dtype}, k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must share one dtype",
    )
    return num_q_heads // num_kv_heads


def check_window(window: int) -> None:
    """A sliding window is a whole number of keys; 0 means none (full causal attention)."""
    require(
        isinstance(window, int) and not isinstance(window, bool) and window >= 0,
        f"window must be an int >= 0 (0: no sliding window), got {window!r}",
    )


def check_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int) -> None:
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    require(block_tables.shape[0] == batch, f"block_tables has {block_tables.shape[0]} rows for {batch} sequences")
    require(seq_lens.shape[0] == batch, f"seq_lens has {seq_lens.shape[0]} entries for {batch} sequences")
