"""The gated MLP activations (SiLU-and-mul, GELU-tanh-and-mul) against the reference, in the interpreter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import reference
from kernels.triton.silu_mul import gelu_tanh_and_mul, silu_and_mul
from kernels.triton.testing import poisoned_allocations, relative_error

# bfloat16: the interpreter rounds float32 to bfloat16 by truncation (numpy has no bfloat16), not to nearest
# as a GPU and the reference do. The two roundings (activation, product) then each differ from the reference
# by up to one ulp (2^-7 relative), a bound of ~2^-6 on any shape; the GPU script checks bfloat16 at 1e-2.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2e-2}
OPS = {"silu_and_mul": silu_and_mul, "gelu_tanh_and_mul": gelu_tanh_and_mul}
SHAPES = [
    (1, 128),
    (5, 200),
    (3, 2200),  # two column blocks
    (2, 3, 96),
    (4, 2),  # d = 1
    (1, 2 * 129),  # odd width, one row
    (4, 2 * 1031),  # odd width over two column blocks
    (300, 2 * 37),  # odd width, many rows
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(op: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (2 * torch.randn(shape)).to(dtype)
    with poisoned_allocations():
        out = OPS[op](x)
    ref = getattr(reference, op)(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("op", OPS)
def test_strided_rows(op: str) -> None:
    x = torch.randn(6, 300)[:, :256]  # rows 300 apart
    assert relative_error(OPS[op](x), getattr(reference, op)(x)) < 1e-6


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's, in the interpreter: gate^3
def test_gelu_tanh_has_no_overflow_or_cancellation_at_the_tails() -> None:
    # Large |gate|: gate^3 overflows float32 and tanh saturates, where 1 + tanh(y) cancels to a few ulp of 1.
    gate = torch.tensor([-1e30, -50.0, -11.0, -5.0, -3.0, -0.5, 0.0, 0.5, 3.0, 11.0, 1e30, float("inf")])
    x = torch.cat([gate, torch.ones_like(gate)])
    want = reference.gelu_tanh_and_mul(x.double())  # float64: torch's float32 loses the tiny negative tail
    out = gelu_tanh_and_mul(x)
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=0), (out, want)


@pytest.mark.parametrize("fn", OPS.values())
def test_odd_last_dim_is_refused(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="must be even"):
        fn(torch.randn(3, 7))
