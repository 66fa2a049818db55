"""Extend attention for CPU tensors beside the native decode kernel.

``kernels.reference.extend_attention`` with the rows that attend as decodes (a decode sharing
a prefill's step, a speculative verify's few rows in bf16) sent to the native
``paged_decode_attention``, each row as one query at its own position. A row is then bitwise
what a decode step gives it: the same kernel, one task per (row, head) whatever the batch, so
greedy speculation and steps shared with a prefill decode exactly as plain decoding does.
Prefill chunks keep the reference's one masked call.

``invariant_extend_attention`` (deterministic serving) sends every row there, prefill chunks
included: a token's attention is then the same bits whether it was computed in a prefill, in
any chunk split, over a cached prefix, in a verify or as a decode.
"""

from __future__ import annotations

from functools import partial

import torch

from kernels import reference


def rows_as_native_decodes(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """``kernels.reference.RowsAsDecodes`` through the native decode kernel."""
    which = torch.repeat_interleave(torch.arange(len(starts), device=q.device), counts)  # each row's sequence
    first = counts.cumsum(0) - counts  # each sequence's first row among these
    j = torch.arange(len(which), device=q.device) - first[which]  # a row's place among its sequence's new tokens
    rows = starts[which] + j
    lens = seq_lens[which] - counts[which] + j + 1  # its prefix, the new tokens before it, itself
    out[rows] = torch.ops.kvmesh_cpu.paged_decode_attention(q[rows], k_cache, v_cache, block_tables[which], lens, scale)


# ``kernels.reference.paged_extend_attention``, its decode rows on the native kernel.
paged_extend_attention = partial(reference.extend_attention, rows_as_native_decodes)


def invariant_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_extend_attention`` with every row computed as a native decode at its own position."""
    starts = query_start_loc[:-1]
    out = torch.empty_like(q)
    rows_as_native_decodes(
        out, q, k_cache, v_cache, block_tables, starts, query_start_loc[1:] - starts, seq_lens, scale
    )
    return out
