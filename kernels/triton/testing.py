"""Helpers for checking kernels against their references, shared by the tests and the GPU script."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in ``out`` gives inf, so NaN never passes."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Make ``torch.empty`` fill new float tensors with NaN (ints with their max value) inside the
    block, so an output element a kernel never writes shows up as NaN instead of stale memory."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
