"""A step's ``AttentionMetadata``: where its new tokens go and what each attends to.

A step of decodes and speculative verifies (every new row samples; a verify has k + 1 rows a
sequence, at most ``DECODE_ROWS_MAX``) is laid out as decodes, one per row: row j of a sequence
gets that sequence's block table and a length that ends at its own position. Every row's K/V is
written before any layer attends, so the row sees its prefix and the new tokens before it,
which is causal attention; and it goes through the decode kernel, so a verify row is bitwise
the decode of its token: greedy speculation decodes exactly as plain decoding does, in every
dtype.

It is also the cheaper layout on CPU. A verify through the extend path paid for its rows'
metadata in every layer and, in float32, for a gathered copy of the sequence's K/V and a
masked SDPA: one sequence of SmolLM2 fp32, a verify of 1 draft cost 34.0 ms against a 26.5 ms
decode, 31.3 ms after moving only its attention to the decode kernel, and the rest was the
per-layer index arithmetic this builds once. A compiled engine runs such steps through its
compiled decode graph as well.

Prefill chunks, however short, keep the extend layout: one masked call over a chunk's rows
reads the K/V once, where rows as decodes would read it once per row; and a compiled engine's
decode graphs are built for steps whose every row samples (a chunk samples one row or none).
"""

from __future__ import annotations

import itertools

import torch

from kernels.reference import DECODE_ROWS_MAX
from kvmesh.engine.model import AttentionMetadata


def step_metadata(
    slots: list[int],
    tables: list[list[int]],
    seq_lens: list[int],
    num_new: list[int],
    device: torch.device,
    every_row_samples: bool,
) -> AttentionMetadata:
    """Metadata for sequences with block tables ``tables`` (padded to one width), holding
    ``seq_lens[i]`` tokens after this step of which the last ``num_new[i]`` are new, written to
    flat cache ``slots`` (in order: sequence 0's new tokens, then sequence 1's, ...);
    ``every_row_samples``: each new token's logits are wanted (decodes and verifies)."""
    if every_row_samples and max(num_new) <= DECODE_ROWS_MAX:
        tables = [t for t, n in zip(tables, num_new) for _ in range(n)]
        seq_lens = [length - n + j + 1 for length, n in zip(seq_lens, num_new) for j in range(n)]
        num_new = [1] * len(seq_lens)

    def longs(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return AttentionMetadata(
        slot_mapping=longs(slots),
        block_tables=longs(tables),
        seq_lens=longs(seq_lens),
        query_start_loc=longs([0, *itertools.accumulate(num_new)]),
        is_decode=all(n == 1 for n in num_new),
    )
