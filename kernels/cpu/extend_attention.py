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
from kernels.rows_as_decodes import every_row_as_decode, rows_as_decodes


def _native_decode(*args: object) -> torch.Tensor:
    return torch.ops.kvmesh_cpu.paged_decode_attention(*args)


# ``kernels.reference.paged_extend_attention``, its decode rows on the native kernel.
paged_extend_attention = partial(reference.extend_attention, partial(rows_as_decodes, _native_decode))
# Every row on the native decode kernel (deterministic serving).
invariant_extend_attention = partial(every_row_as_decode, _native_decode)
