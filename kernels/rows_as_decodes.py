"""Extend-attention rows computed one by one by a decode attention kernel, each at its own position.

A decode kernel's result for a token depends only on that token's query, its sequence's cached
keys and values, and its length. Sending an extend's rows through it, each as the decode of its
token, makes the row the same bits whether it was computed in a prefill (whole or in any chunk
split), over a cached prefix, in a speculative verify or as a decode step. The CPU native and the
Triton decode kernels both plug in here (``kernels.cpu.extend_attention``, ``kernels.triton``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (q [R, Hq, D], k_cache, v_cache, block_tables [R, blocks], seq_lens [R], scale, window) -> [R, Hq, D]
DecodeAttention = Callable[..., torch.Tensor]


def rows_as_decodes(
    decode_attention: DecodeAttention,
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> None:
    """Writes into ``out`` the rows of the sequences whose new tokens start at ``starts`` and number
    ``counts`` (``kernels.reference.RowsAsDecodes``), each row one query of ``decode_attention``."""
    which = torch.repeat_interleave(torch.arange(len(starts), device=q.device), counts)  # each row's sequence
    first = counts.cumsum(0) - counts  # each sequence's first row among these
    j = torch.arange(len(which), device=q.device) - first[which]  # a row's place among its sequence's new tokens
    rows = starts[which] + j
    lens = seq_lens[which] - counts[which] + j + 1  # its prefix, the new tokens before it, itself
    out[rows] = decode_attention(q[rows], k_cache, v_cache, block_tables[which], lens, scale, window)


def every_row_as_decode(
    decode_attention: DecodeAttention,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """``paged_extend_attention`` with every row, prefill chunks included, a decode by ``decode_attention``:
    the batch-invariant extend attention of deterministic serving."""
    starts = query_start_loc[:-1]
    out = torch.empty_like(q)
    counts = query_start_loc[1:] - starts
    rows_as_decodes(decode_attention, out, q, k_cache, v_cache, block_tables, starts, counts, seq_lens, scale, window)
    return out
