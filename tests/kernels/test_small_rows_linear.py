"""Few-row products on oneDNN-reordered weights: same results as nn.Linear, shared parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.small_rows_linear import DEFAULT_MAX_ROWS, MIN_ROWS, SmallRowsLinear, use_small_rows_linears
from kvmesh.errors import FailedPrecondition


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 40, DEFAULT_MAX_ROWS, DEFAULT_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_gives_the_plain_product(rows, bias, dtype):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias, dtype=dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        want = F.linear(x, linear.weight, linear.bias)
        got = SmallRowsLinear.of(linear)(x)
    assert got.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}  # bf16: its own defaults
    torch.testing.assert_close(got, want, **tolerance)


def test_the_row_range_on_the_reordered_weight_depends_on_the_dtype():
    assert MIN_ROWS == {torch.float32: 4, torch.bfloat16: 1}
    assert SmallRowsLinear.of(nn.Linear(8, 8, dtype=torch.bfloat16)).min_rows == 1
    assert SmallRowsLinear.of(nn.Linear(8, 8)).min_rows == 4


def test_leading_dimensions_are_kept():
    linear = nn.Linear(32, 48, bias=False)
    x = torch.randn(2, 3, 32)  # 6 rows
    with torch.inference_mode():
        torch.testing.assert_close(SmallRowsLinear.of(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_the_swap_shares_parameters_and_keeps_the_state_dict():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    before = {k: v for k, v in model.state_dict().items()}
    weights = [model[0].weight, model[2].weight]
    assert use_small_rows_linears(model) == 2
    assert isinstance(model[0], SmallRowsLinear) and model[0].weight is weights[0]
    assert model[2].weight is weights[1]
    assert model.state_dict().keys() == before.keys()


def test_a_float16_weight_is_refused():
    with pytest.raises(FailedPrecondition, match="float32 or bfloat16"):
        SmallRowsLinear.of(nn.Linear(8, 8, dtype=torch.float16))
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.float16))
    assert use_small_rows_linears(model) == 0  # left as it is


def test_training_takes_the_plain_differentiable_product():
    linear = SmallRowsLinear.of(nn.Linear(8, 4))
    x = torch.randn(5, 8, requires_grad=True)
    linear(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None
