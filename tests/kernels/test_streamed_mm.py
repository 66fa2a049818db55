"""The native streamed product of float weights (kernels/cpu/streamed_mm.cpp): torch's product
up to summation order and the output's rounding, rows independent of their batch, the
refusals, the GEMM past the streamed rows, and its tracing by torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.triton.testing import relative_error
from tests.kernels.native import native_cpu_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def streamed_mm():
    native_cpu_kernels()
    return torch.ops.kvmesh_cpu.streamed_mm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 33])  # passes of 1-6 rows; past 32 torch's GEMM
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_float32_product(streamed_mm, dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    n, k = 203, 200  # neither a multiple of the 4-row weight blocks nor of 16 columns
    weight = torch.randn(n, k).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    out = streamed_mm(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, n)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32: summation order only; 16 bits: the output's one rounding (and past 32 rows the GEMM's own).
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert relative_error(out.double(), exact) < tol


def test_float32_is_torch_up_to_summation_order(streamed_mm) -> None:
    torch.manual_seed(0)
    weight, x, bias = torch.randn(576, 1536), torch.randn(3, 1536), torch.randn(576)
    torch.testing.assert_close(streamed_mm(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_their_batch(streamed_mm, dtype: torch.dtype) -> None:
    """A verify's k + 1 rows get bit for bit what each row gets alone (up to the streamed limit)."""
    torch.manual_seed(1)
    weight = torch.randn(300, 576).to(dtype)
    x = torch.randn(32, 576).to(dtype)
    alone = torch.cat([streamed_mm(x[i : i + 1], weight) for i in range(32)])
    for rows in (2, 3, 5, 6, 7, 16, 32):
        assert torch.equal(streamed_mm(x[:rows], weight), alone[:rows])


def test_bad_inputs_are_refused(streamed_mm) -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="x has 15 columns, weight 16"):
        streamed_mm(torch.randn(1, 15), weight)
    with pytest.raises(RuntimeError, match="weight must be a contiguous 2-D tensor of x's dtype"):
        streamed_mm(torch.randn(1, 16), weight.bfloat16())
    with pytest.raises(RuntimeError, match="weight must be a contiguous 2-D tensor"):
        streamed_mm(torch.randn(1, 8), weight.t())
    with pytest.raises(RuntimeError, match="bias must have 8 values"):
        streamed_mm(torch.randn(1, 16), weight, torch.randn(7))
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16, not Double"):
        streamed_mm(torch.randn(1, 16, dtype=torch.float64), weight.double())


def test_under_torch_compile(streamed_mm) -> None:
    weight, bias = torch.randn(64, 96), torch.randn(64)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(streamed_mm(x * 2, weight, bias))

    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for rows in (1, 3):
        x = torch.randn(rows, 96)
        assert torch.equal(compiled(x), layer(x))
