"""Multi-head Latent Attention decode (DeepSeek-V3's absorbed form): every query head attends to the
one latent row a token, which is its key and, through its first ``v_dim`` values, its value.

The generic decode kernel would take all 128 heads as one GQA group with 1024-wide (576 padded)
float32 accumulators, and read each row twice (as K and as V): compiled for sm_90 it needs 384 KB of
shared memory, so it does not launch. Here stage 1 gives every (block of BLOCK_H heads, split of the
sequence's tokens, sequence) its own program, which loads a tile of latent rows once and uses it for
all its heads, twice over: transposed for q·K and as it is for P @ V. The row's width is not a power
of 2 (512 + 64), so q·K is two dots, over the value columns [0, v_dim) and over the key-only rest
[v_dim, D), each padded to its own power of 2; only v_dim outputs are accumulated. Head blocks are the
grid's fastest axis, so the programs reading the same rows run side by side and share them through
L2. Stage 2 is the decode kernel's merge.

The split size is a function of the sequence's own length and the model's head count (``_mla_config``;
``_split_tokens`` in the kernel, no host sync) and the tiles are fixed, so a sequence's output is
bitwise the same whatever else is in the batch, as for ``paged_decode_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._attention import LOG2_E, check_block_tables, paged_row_offsets
from kernels.triton._validate import check_same_device, check_tensor, require
from kernels.triton.decode_attention import _NO_WINDOW, _decode_merge_kernel, _split_tokens

# At most this many splits a sequence (the merge holds them all in one tile), as for the decode kernel.
_MAX_SPLITS = 16


@triton.jit
def _mla_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_heads,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_cache_block,
    stride_cache_token,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    split_tokens = _split_tokens(seq_len, MIN_SPLIT_TOKENS, MAX_SPLITS, BLOCK_N)
    start = split * split_tokens
    if start < seq_len:
        end = tl.minimum(start + split_tokens, seq_len)
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < num_heads
        v_dims = tl.arange(0, BLOCK_V)  # the value columns, also the first part of the key
        r_dims = V_DIM + tl.arange(0, BLOCK_R)  # the key-only rest (DeepSeek-V3: the 64 rotary values)
        v_mask = v_dims < V_DIM
        r_mask = r_dims < HEAD_DIM
        q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
        q_v = tl.load(q_rows + v_dims[None, :], mask=head_mask[:, None] & v_mask[None, :], other=0.0)
        q_r = tl.load(q_rows + r_dims[None, :], mask=head_mask[:, None] & r_mask[None, :], other=0.0)
        table = block_tables_ptr + seq * stride_bt
        acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            tokens = tile_start + tl.arange(0, BLOCK_N)
            token_mask = tokens < end
            rows_at = paged_row_offsets(table, tokens, token_mask, BLOCK_SIZE, stride_cache_block, stride_cache_token)
            rows = tl.load(cache_ptr + rows_at[:, None] + v_dims[None, :],
                           mask=token_mask[:, None] & v_mask[None, :], other=0.0)  # fmt: skip
            rest = tl.load(cache_ptr + rows_at[:, None] + r_dims[None, :],
                           mask=token_mask[:, None] & r_mask[None, :], other=0.0)  # fmt: skip
            scores = tl.dot(q_v, tl.trans(rows))
            scores = tl.dot(q_r, tl.trans(rest), scores) * qk_scale
            scores = tl.where(token_mask[None, :], scores, float("-inf"))
            # Online softmax; a split's first tile holds its first token, so m_i is finite after it.
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(rows.dtype), rows, acc * alpha[:, None])
            m_i = m_new
        part = (seq * num_heads + heads) * MAX_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * V_DIM + v_dims[None, :], acc / l_i[:, None],
                 mask=head_mask[:, None] & v_mask[None, :])  # fmt: skip
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=head_mask)


# 16-bit rows at D = 576, by head block: (BLOCK_N, num_warps), 3 stages (the row loads become cp.async).
# Each is the widest key tile with no spills when compiled for sm_90 (64 heads: wgmma, 254 registers;
# 32: 189; 16: 183); 4 warps at 64 heads serialize the wgmmas and spill, 32 keys at 64 heads spill.
_TILES_16BIT = {64: (16, 8), 32: (32, 8), 16: (32, 4)}


def _mla_config(num_heads: int, elem_bytes: int) -> dict[str, int]:
    """Head block, key tile, warps, stages and the shortest split, from the model's head count and
    dtype alone (never the batch).

    The head block holds as many heads as fit (at most 64, at least the 16 a dot takes): each head
    block reads the latent rows again (from L2 if its neighbours just did), so DeepSeek-V3's 128
    heads read a row twice, not 8 times. float32 (a check dtype, tf32 dots on a GPU) keeps 16 heads
    of 16 keys, its one fit without spills (248 registers).

    A split writes H × v_dim float32 partials that the merge reads back: at 128 heads, 256 KB, what
    a split of 256 latent rows reads. Splits of at least 16 tokens a head (2048 at 128 heads, 256 at
    16) keep that traffic near a fifth of the rows' bytes; 8 × 32k still gets 16 splits a sequence.
    """
    min_split = max(256, 16 * num_heads)
    if elem_bytes > 2:
        return {"BLOCK_H": 16, "BLOCK_N": 16, "MIN_SPLIT_TOKENS": min_split, "num_warps": 4, "num_stages": 2}
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    block_n, warps = _TILES_16BIT[block_h]
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "MIN_SPLIT_TOKENS": min_split, "num_warps": warps,
            "num_stages": 3}  # fmt: skip


def _check_latent_cache(q: torch.Tensor, latent_cache: torch.Tensor, v_dim: int) -> None:
    check_tensor("latent_cache", latent_cache, 4)
    head_dim = q.shape[-1]
    require(latent_cache.shape[2] == 1, f"latent_cache holds one row a token: shape {tuple(latent_cache.shape)}")
    require(latent_cache.shape[3] == head_dim, f"latent_cache width {latent_cache.shape[3]} is not q's {head_dim}")
    require(latent_cache.dtype == q.dtype, f"q {q.dtype} and latent_cache {latent_cache.dtype} must share one dtype")
    require(
        isinstance(v_dim, int) and not isinstance(v_dim, bool) and 0 < v_dim <= head_dim,
        f"v_dim must be an int in [1, {head_dim}], got {v_dim!r}",
    )


def mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """q [B, H, D]; latent_cache [num_blocks, block_size, 1, D]; block_tables [B, max_blocks];
    seq_lens [B] (each ≥ 1, counting the query token, whose row is already cached). Returns
    [B, H, v_dim] in q's dtype: each head's softmax over the rows' first v_dim values."""
    check_tensor("q", q, 3)
    _check_latent_cache(q, latent_cache, v_dim)
    batch, num_heads, head_dim = q.shape
    check_block_tables(block_tables, seq_lens, batch)
    check_same_device(q=q, latent_cache=latent_cache, block_tables=block_tables, seq_lens=seq_lens)
    out = torch.empty((batch, num_heads, v_dim), dtype=q.dtype, device=q.device)
    if batch == 0 or num_heads == 0:
        return out
    cfg = _mla_config(num_heads, q.element_size())
    block_size = latent_cache.shape[1]
    # Enough splits for the longest sequence the block table can hold; programs past a sequence's
    # own count return at once.
    grid_splits = min(_MAX_SPLITS, triton.cdiv(block_tables.shape[1] * block_size, cfg["MIN_SPLIT_TOKENS"]))
    part_out = torch.empty((batch, num_heads, _MAX_SPLITS, v_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_heads, _MAX_SPLITS), dtype=torch.float32, device=q.device)
    _mla_split_kernel[(triton.cdiv(num_heads, cfg["BLOCK_H"]), grid_splits, batch)](
        q, latent_cache, block_tables, seq_lens, part_out, part_lse,
        scale * LOG2_E, num_heads,
        q.stride(0), q.stride(1), block_tables.stride(0), latent_cache.stride(0), latent_cache.stride(1),
        HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_SIZE=block_size, MAX_SPLITS=_MAX_SPLITS,
        BLOCK_V=max(16, triton.next_power_of_2(v_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(head_dim - v_dim)),  # a dot's K is at least 16
        **cfg,
    )  # fmt: skip
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, seq_lens, out, _NO_WINDOW, v_dim,
        MIN_SPLIT_TOKENS=cfg["MIN_SPLIT_TOKENS"], MAX_SPLITS=_MAX_SPLITS, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_D=triton.next_power_of_2(v_dim), num_warps=4,
    )  # fmt: skip
    return out
