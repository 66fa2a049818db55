"""The one order tensor-parallel partial sums are added in: float32, rank 0 first.

Every rank adds the same parts in the same order, so every rank ends with the same bits, whatever
carried the parts (shared memory, or a gathered process group under deterministic serving).
"""

from __future__ import annotations

import torch


def sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = parts[0] + parts[1] + ..., accumulated in float32 in that order (``out`` may be one of
    the parts; the parts are only read)."""
    total = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        total += part.float()
    out.copy_(total)
