"""Paged prefill / extend attention: a varlen batch of new tokens over each sequence's
cached prefix (the new tokens' own K/V already written to the cache).

One program per (tile of BLOCK_M new tokens of one sequence, query head). Keys
before the tile's first query position are visible to every row and run without a
mask; only the keys on the diagonal are masked, and keys after the tile's last
query are never loaded (fully masked tiles are skipped).

Tiles are found without a host sync: sequence i owns tile indices from
``query_start_loc[i] // BLOCK_M + i`` up to sequence i+1's first, at least
ceil(new_tokens_i / BLOCK_M) of them, and each program finds its sequence by a
binary search over query_start_loc. Within a sequence the indices run from its
last (most keys) tile to its first, so the heavy tiles start early and the last
wave is light. Query heads are the fastest grid axis: the heads of one GQA group
read the same K/V tiles at about the same time, from L2. A tile's work depends
only on its own sequence, so outputs are bitwise the same whatever else is in the batch.

A sliding window (``window`` W > 0; the row at position p sees keys p - W < k <= p)
compiles a second variant of the kernel (WINDOWED): a tile reads keys from its first
row's window start, masks the keys some row's window has not reached yet or has left,
and runs unmasked only over the keys inside every row's window. Keys before the
first row's window are never read. Full attention (W = 0) runs the kernel as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._attention import (
    LOG2_E,
    attend_tile,
    check_block_tables,
    check_paged_caches,
    check_window,
    paged_row_offsets,
)
from kernels.triton._validate import INDEX_DTYPES, check_same_device, check_tensor, require

# Windows at least this long cover any sequence; clamped to it, the kernel's window stays an int32.
_LONGEST_WINDOW = 2**30


@triton.jit
def _first_tile(query_start_loc_ptr, seq, BLOCK_M: tl.constexpr):
    return tl.load(query_start_loc_ptr + seq).to(tl.int32) // BLOCK_M + seq


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    num_q_heads,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    # The last sequence whose first tile is at or before this program's index.
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _first_tile(query_start_loc_ptr, mid, BLOCK_M) <= tile:
            lo = mid
        else:
            hi = mid
    seq = lo
    seq_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    new_tokens = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - seq_start
    m_start = (_first_tile(query_start_loc_ptr, seq + 1, BLOCK_M) - 1 - tile) * BLOCK_M
    if m_start < new_tokens:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        prefix = seq_len - new_tokens
        rows = m_start + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_mask = rows < new_tokens
        dim_mask = dims < head_dim
        q_rows = (seq_start + rows).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
        q_pos = prefix + rows
        kv_head = head // GROUP
        k_base = k_cache_ptr + kv_head * stride_cache_head
        v_base = v_cache_ptr + kv_head * stride_cache_head
        table = block_tables_ptr + seq * stride_bt
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        # Keys [0, prefix + m_start] are visible to every row of the tile: whole tiles of them need no mask.
        unmasked_end = (prefix + m_start + 1) // BLOCK_N * BLOCK_N
        # Keys past the tile's last query position are never read.
        masked_end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
        unmasked_start = 0
        diagonal_start = unmasked_end
        if WINDOWED:
            # The first row's window starts at first_key; keys from shared_key on are in every row's
            # window (the last row's, at position masked_end - 1, starts there). Keys between the two
            # are masked, as are all of them when no whole key tile lies inside every window.
            first_key = tl.maximum(prefix + m_start - window + 1, 0)
            shared_key = tl.maximum(masked_end - window, 0)
            unmasked_start = tl.minimum(tl.cdiv(shared_key, BLOCK_N) * BLOCK_N, unmasked_end)
            # A row's window may begin several tiles after first_key: rows may see no key in a tile.
            for n in range(first_key, unmasked_start, BLOCK_N):
                keys = n + tl.arange(0, BLOCK_N)
                key_mask = keys < unmasked_start
                rows_at = paged_row_offsets(table, keys, key_mask, BLOCK_SIZE, stride_cache_block,
                                            stride_cache_token)  # fmt: skip
                k = tl.load(k_base + rows_at[None, :] + dims[:, None], mask=dim_mask[:, None] & key_mask[None, :],
                            other=0.0)  # fmt: skip
                v = tl.load(v_base + rows_at[:, None] + dims[None, :], mask=key_mask[:, None] & dim_mask[None, :],
                            other=0.0)  # fmt: skip
                # These keys are before every row's position: only the window's start masks them.
                visible = (keys[None, :] > q_pos[:, None] - window) & key_mask[None, :]
                acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, True, True)
            # Without unmasked tiles the diagonal starts at the first row's window, not before it.
            diagonal_start = tl.maximum(unmasked_end, first_key)
        for n in range(unmasked_start, unmasked_end, BLOCK_N):
            keys = n + tl.arange(0, BLOCK_N)
            rows_at = paged_row_offsets(table, keys, keys < unmasked_end, BLOCK_SIZE, stride_cache_block,
                                        stride_cache_token)  # fmt: skip
            k = tl.load(k_base + rows_at[None, :] + dims[:, None], mask=dim_mask[:, None], other=0.0)
            v = tl.load(v_base + rows_at[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, row_mask[:, None], qk_scale, False)
        # The diagonal: keys up to the tile's last query position, causally masked.
        for n in range(diagonal_start, masked_end, BLOCK_N):
            keys = n + tl.arange(0, BLOCK_N)
            key_mask = keys < masked_end
            rows_at = paged_row_offsets(table, keys, key_mask, BLOCK_SIZE, stride_cache_block, stride_cache_token)
            k = tl.load(k_base + rows_at[None, :] + dims[:, None], mask=dim_mask[:, None] & key_mask[None, :],
                        other=0.0)  # fmt: skip
            v = tl.load(v_base + rows_at[:, None] + dims[None, :], mask=key_mask[:, None] & dim_mask[None, :],
                        other=0.0)  # fmt: skip
            visible = (keys[None, :] <= q_pos[:, None]) & key_mask[None, :]
            if WINDOWED:
                visible = visible & (keys[None, :] > q_pos[:, None] - window)
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, True, WINDOWED)
        if WINDOWED:
            # A padding row past the new tokens can have no key in its window (l_i = 0): it is never
            # stored, but dividing by 1 keeps it finite instead of computing 0 / 0.
            l_i = tl.where(row_mask, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_rows[:, None] * num_q_heads + head) * head_dim + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])  # fmt: skip


def _extend_config(head_dim: int, elem_bytes: int) -> dict[str, int]:
    """Query/key tiles and warps by the bytes of one K/V row: 128×64 tiles keep Hopper's
    tensor cores busy for bf16 rows up to D=128 with three pipeline stages in shared memory
    (about 100 KB); wider rows (bf16 D=256, fp32) take smaller tiles to stay well inside it."""
    row_bytes = head_dim * elem_bytes
    if row_bytes <= 256:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    if row_bytes <= 512:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [T, Hq, D] packs sequence i's new tokens at query_start_loc[i]:query_start_loc[i+1];
    seq_lens[i] counts its prefix plus new tokens. Returns [T, Hq, D]. ``window`` > 0:
    sliding-window attention, the new token at position p sees keys p - window < k <= p
    (transformers' sliding window); 0: full causal attention."""
    check_tensor("q", q, 3)
    check_window(window)
    group = check_paged_caches(q, k_cache, v_cache)
    check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    batch = query_start_loc.shape[0] - 1
    require(batch >= 0, "query_start_loc needs at least one entry")
    check_block_tables(block_tables, seq_lens, batch)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )  # fmt: skip
    total, num_q_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if total == 0 or batch == 0:
        return out
    cfg = _extend_config(head_dim, q.element_size())
    grid = (num_q_heads, total // cfg["BLOCK_M"] + batch)
    _extend_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2_E, min(window, _LONGEST_WINDOW), batch,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads, head_dim,
        GROUP=group, BLOCK_SIZE=k_cache.shape[1], BLOCK_D=triton.next_power_of_2(head_dim), WINDOWED=window > 0,
        **cfg,
    )  # fmt: skip
    return out
