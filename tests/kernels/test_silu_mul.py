"""SiLU-and-mul against the reference, in the interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.silu_mul import silu_and_mul
from kernels.triton.testing import poisoned_allocations, relative_error

TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (5, 200), (3, 2200), (2, 3, 96)])  # 2200: two column blocks
def test_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (2 * torch.randn(shape)).to(dtype)
    with poisoned_allocations():
        out = silu_and_mul(x)
    ref = reference.silu_and_mul(x)
    assert out.shape == ref.shape
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_strided_rows() -> None:
    x = torch.randn(6, 300)[:, :256]  # rows 300 apart
    assert relative_error(silu_and_mul(x), reference.silu_and_mul(x)) < 1e-6
