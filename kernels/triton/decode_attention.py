"""Paged decode attention (flash-decoding): one query token per sequence.

Stage 1 cuts each sequence's keys into splits and gives every (sequence, KV head,
split) its own program, so a few long sequences still fill the GPU; the program
packs the KV head's whole GQA group as the rows of one tile, reading each K/V
row once for all of them. It writes the split's normalized output and its
log-sum-exp. Stage 2 merges the splits per (sequence, query head).

A sliding window (``window`` W > 0) starts the keys at max(0, seq_len - W): the
keys before it are never read, and the splits cut only the windowed span.

The split size is a function of the sequence's own (windowed) span alone (computed
in the kernel from seq_lens and the window, no host sync), so a sequence's output
is bitwise the same whatever else is in the batch.
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
from kernels.triton._validate import check_same_device, check_tensor

# Splits are at least this many tokens (shorter ones would cost more to merge than they
# save) and at most this many per sequence (the merge holds them all in one tile).
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 16
# The kernels' window for full attention (window=0): longer than any sequence, and seq_len minus
# it cannot overflow int32.
_NO_WINDOW = 2**31 - 1


@triton.jit
def _split_tokens(span, MIN_SPLIT_TOKENS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per split for a sequence attending to span keys: a multiple of the key tile. An empty
    sequence gets one empty split (and a NaN output, as in the reference), not a division by 0."""
    num_splits = tl.maximum(tl.minimum(tl.cdiv(span, MIN_SPLIT_TOKENS), MAX_SPLITS), 1)
    return tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _first_key(seq_len, window):
    """The first key the query (at position seq_len - 1) sees: the window holds it and the
    window - 1 keys before it. Full attention comes in as a window of _NO_WINDOW keys."""
    return tl.maximum(seq_len - window, 0)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    window,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_key = _first_key(seq_len, window)
    split_tokens = _split_tokens(seq_len - first_key, MIN_SPLIT_TOKENS, MAX_SPLITS, BLOCK_N)
    start = first_key + split * split_tokens
    if start < seq_len:
        end = tl.minimum(start + split_tokens, seq_len)
        rows = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + rows
        row_mask = rows < GROUP
        dim_mask = dims < head_dim
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        k_base = k_cache_ptr + kv_head * stride_cache_head
        v_base = v_cache_ptr + kv_head * stride_cache_head
        table = block_tables_ptr + seq * stride_bt
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            tokens = tile_start + tl.arange(0, BLOCK_N)
            token_mask = tokens < end
            rows_at = paged_row_offsets(table, tokens, token_mask, BLOCK_SIZE, stride_cache_block, stride_cache_token)
            k = tl.load(k_base + rows_at[None, :] + dims[:, None],
                        mask=dim_mask[:, None] & token_mask[None, :], other=0.0)  # fmt: skip
            v = tl.load(v_base + rows_at[:, None] + dims[None, :],
                        mask=token_mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, token_mask[None, :], qk_scale, True)
        part = (seq * GROUP * tl.num_programs(1) + heads) * MAX_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * head_dim + dims[None, :], acc / l_i[:, None],
                 mask=row_mask[:, None] & dim_mask[None, :])  # fmt: skip
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    window,
    head_dim,
    MIN_SPLIT_TOKENS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    span = seq_len - _first_key(seq_len, window)
    num_splits = tl.cdiv(span, _split_tokens(span, MIN_SPLIT_TOKENS, MAX_SPLITS, BLOCK_N))
    splits = tl.arange(0, MAX_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    part = (seq * tl.num_programs(1) + head) * MAX_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + part[:, None] * head_dim + dims[None, :],
                    mask=split_mask[:, None] & (dims[None, :] < head_dim), other=0.0)  # fmt: skip
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + (seq * tl.num_programs(1) + head) * head_dim + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)  # fmt: skip


def _decode_config(head_dim: int, elem_bytes: int) -> dict[str, int]:
    """Key tile and warps: 64 keys of bf16 × 128 dims (16 KB per K or V tile) at most, fewer
    keys for wider rows, so two pipeline stages leave room for several programs per SM."""
    block_n = max(16, min(64, 16384 // (head_dim * elem_bytes)))
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hk, D]; block_tables [B, max_blocks];
    seq_lens [B] (each ≥ 1, counting the query token, whose K/V is already cached). Returns [B, Hq, D].
    ``window`` > 0: sliding-window attention, the query (position seq_len - 1) sees only the last
    ``window`` keys, itself included; 0: all of them. The 7th positional parameter, as
    ``kernels.rows_as_decodes`` passes it."""
    check_tensor("q", q, 3)
    check_window(window)
    group = check_paged_caches(q, k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    check_block_tables(block_tables, seq_lens, batch)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    cfg = _decode_config(head_dim, q.element_size())
    block_size = k_cache.shape[1]
    # The grid covers the most splits any sequence that fits its block table can need (a window
    # bounds the span a split count is cut from); programs past a sequence's own count return at once.
    longest = block_tables.shape[1] * block_size
    if window:
        longest = min(longest, window)
    window_keys = min(window, _NO_WINDOW) if window else _NO_WINDOW
    grid_splits = min(_MAX_SPLITS, triton.cdiv(longest, _MIN_SPLIT_TOKENS))
    part_out = torch.empty((batch, num_q_heads, _MAX_SPLITS, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_q_heads, _MAX_SPLITS), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_q_heads // group, grid_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        scale * LOG2_E, window_keys,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        head_dim,
        GROUP=group, BLOCK_SIZE=block_size, MIN_SPLIT_TOKENS=_MIN_SPLIT_TOKENS, MAX_SPLITS=_MAX_SPLITS,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs at least 16 rows
        BLOCK_D=block_d, **cfg,
    )  # fmt: skip
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out, part_lse, seq_lens, out, window_keys, head_dim,
        MIN_SPLIT_TOKENS=_MIN_SPLIT_TOKENS, MAX_SPLITS=_MAX_SPLITS, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
    return out
