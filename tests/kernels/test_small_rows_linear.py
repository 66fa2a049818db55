"""Few-row products on oneDNN-reordered weights: same results as nn.Linear, shared parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import small_rows_linear
from kernels.errors import KernelUnavailable
from kernels.small_rows_linear import (
    DEFAULT_MAX_ROWS,
    MIN_ROWS,
    STREAMED_ROWS_TRIED,
    SmallRowsLinear,
    calibrate_min_rows,
    calibrate_streamed_rows,
    fastest_alternating,
    fewest_rows_that_pay,
    most_rows_that_stream,
    one_row_runs_reordered,
    reorder_unavailable,
    use_small_rows_linears,
)
from tests.kernels.native import native_cpu_kernels


def reorders_here(dtype: torch.dtype) -> None:
    """Skip, saying why, where oneDNN cannot reorder a ``dtype`` weight (bfloat16 on a plain AVX2 CPU)."""
    if (why := reorder_unavailable(dtype)) is not None:
        pytest.skip(f"oneDNN cannot reorder {dtype} weights on this CPU: {why}")


def test_a_dtype_this_cpu_cannot_reorder_stays_a_plain_linear(monkeypatch):
    monkeypatch.setattr(
        small_rows_linear, "reorder_unavailable", lambda dtype: "needs avx512" if dtype == torch.bfloat16 else None
    )
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, dtype=torch.bfloat16))
    assert use_small_rows_linears(model, calibrate=False) == 1
    assert type(model[0]) is SmallRowsLinear and type(model[1]) is nn.Linear
    with pytest.raises(KernelUnavailable, match="cannot run torch.bfloat16 here: needs avx512"):
        SmallRowsLinear.of(model[1])
    assert torch.bfloat16 not in small_rows_linear.small_rows_dtypes()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 40, DEFAULT_MAX_ROWS, DEFAULT_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_gives_the_plain_product(rows, bias, dtype):
    reorders_here(dtype)
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
    reorders_here(torch.bfloat16)
    assert MIN_ROWS == {torch.float32: 4, torch.bfloat16: 1}
    assert SmallRowsLinear.of(nn.Linear(8, 8, dtype=torch.bfloat16)).min_rows == 1
    assert SmallRowsLinear.of(nn.Linear(8, 8)).min_rows == 4  # until calibrated


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
    with pytest.raises(KernelUnavailable, match="float32 or bfloat16"):
        SmallRowsLinear.of(nn.Linear(8, 8, dtype=torch.float16))
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.float16))
    assert use_small_rows_linears(model) == 0  # left as it is


def test_training_takes_the_plain_differentiable_product():
    linear = SmallRowsLinear.of(nn.Linear(8, 4))
    x = torch.randn(5, 8, requires_grad=True)
    linear(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


@pytest.mark.parametrize(
    ("plain", "reordered", "floor"),
    [
        ({1: 35.0, 2: 41.0, 3: 42.0}, {1: 50.0, 2: 50.0, 3: 50.0}, 4),  # MKL wins below 4 rows (the Intel dev box)
        ({1: 35.7, 2: 58.5, 3: 74.5}, {1: 17.7, 2: 19.0, 3: 12.7}, 1),  # oneDNN wins everywhere (Zen 5)
        ({1: 30.0, 2: 41.0, 3: 42.0}, {1: 31.0, 2: 40.0, 3: 40.0}, 2),  # from 2 rows on
        ({1: 30.0, 2: 39.0, 3: 42.0}, {1: 29.0, 2: 40.0, 3: 40.0}, 3),  # 1 row alone is no run down to it
    ],
)
def test_the_float32_floor_is_the_fewest_rows_from_which_the_reordered_weight_wins(plain, reordered, floor):
    assert fewest_rows_that_pay(plain, reordered, default=4) == floor


def test_the_timed_paths_take_turns_so_passing_load_falls_on_both():
    calls = []
    best = fastest_alternating(3, (lambda: calls.append("plain"), lambda: calls.append("reordered")))
    assert calls == ["plain", "reordered"] * 4  # one untimed call each, then 3 timed turns
    assert len(best) == 2 and all(0 <= t < 1 for t in best)


def test_calibration_gives_every_float32_module_one_floor_and_the_same_products():
    torch.manual_seed(0)
    modules = [SmallRowsLinear.of(nn.Linear(64, 96)) for _ in range(3)]
    floor = calibrate_min_rows(modules, repeats=1)
    assert 1 <= floor <= MIN_ROWS[torch.float32] and {m.min_rows for m in modules} == {floor}
    x = torch.randn(2, 64)
    with torch.inference_mode():
        for m in modules:
            torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


def test_a_graph_being_traced_takes_the_plain_product_for_inductor_to_pack():
    torch.manual_seed(0)
    plain = nn.Linear(64, 96)
    linear = SmallRowsLinear.of(plain)
    linear.min_rows = 1  # what calibration says where oneDNN wins one row (Zen 5)
    graphs = []

    def record(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    compiled = torch.compile(linear, backend=record, fullgraph=True)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), plain(x), rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert torch._C._nn.linear in targets or F.linear in targets, targets
    assert not any("mkldnn" in str(t) for t in targets), targets


@pytest.mark.parametrize(
    ("own", "streamed", "most"),
    [
        ({1: 20.0, 2: 29.0, 3: 29.0}, {1: 12.0, 2: 15.0, 3: 19.0}, 3),  # streams every tried count
        ({1: 20.0, 2: 29.0, 3: 29.0}, {1: 12.0, 2: 30.0, 3: 19.0}, 1),  # a count it loses ends the run
        ({1: 10.0, 2: 29.0, 3: 29.0}, {1: 12.0, 2: 15.0, 3: 19.0}, 0),  # one row is not faster: none stream
    ],
)
def test_rows_stream_up_to_the_first_count_where_the_native_product_loses(own, streamed, most):
    assert most_rows_that_stream(own, streamed) == most


def _graph_targets(module: nn.Module, x: torch.Tensor, dynamic: bool) -> set[object]:
    graphs = []

    def record(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(module, backend=record, fullgraph=True, dynamic=dynamic)(x)
    (graph,) = graphs
    return {node.target for node in graph.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calibration_gives_every_module_one_streamed_row_count_and_the_same_products(dtype):
    native_cpu_kernels()
    torch.manual_seed(0)
    modules = [SmallRowsLinear.of(nn.Linear(64, 96, dtype=dtype)) for _ in range(3)]
    most = calibrate_streamed_rows(modules, repeats=1)
    assert 0 <= most <= STREAMED_ROWS_TRIED and {m.streamed_rows for m in modules} == {most}
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    with torch.inference_mode():
        for rows in range(1, STREAMED_ROWS_TRIED + 2):
            x = torch.randn(rows, 64, dtype=dtype)
            for m in modules:
                torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_up_to_the_streamed_count_run_the_native_product(dtype):
    native_cpu_kernels()
    reorders_here(dtype)
    torch.manual_seed(0)
    plain = nn.Linear(64, 96, dtype=dtype)
    linear = SmallRowsLinear.of(plain)
    linear.streamed_rows = 2
    with torch.inference_mode():
        for rows in (1, 2):  # streamed: each row what it gets alone, the native op's guarantee
            x = torch.randn(rows, 64, dtype=dtype)
            assert torch.equal(linear(x), torch.ops.kvmesh_cpu.streamed_mm(x, plain.weight, plain.bias))

    # A graph traced for a static row count streams it; a graph for any row count takes the plain product.
    def streams(x: torch.Tensor, dynamic: bool) -> bool:
        return any("streamed_mm" in str(t) for t in _graph_targets(linear, x, dynamic))

    assert streams(torch.randn(1, 64, dtype=dtype), dynamic=False)
    assert not streams(torch.randn(3, 64, dtype=dtype), dynamic=False)
    assert not streams(torch.randn(2, 64, dtype=dtype), dynamic=True)


def test_a_float32_row_that_streams_keeps_the_one_row_graph_static():
    model = nn.Sequential(SmallRowsLinear.of(nn.Linear(8, 8)))
    model[0].min_rows = 1  # the reordered weight wins one row (Zen 5) ...
    assert one_row_runs_reordered(model)
    model[0].streamed_rows = 1  # ... but the streamed product wins it over both
    assert not one_row_runs_reordered(model)


def test_no_rows_take_the_plain_product_when_nothing_streams():
    # A prefill chunk that samples no row hands the head zero rows; with no streamed rows (no native
    # kernels on this CPU, or a calibration that chose none) that must not call streamed_mm.
    linear = SmallRowsLinear.of(nn.Linear(8, 4))
    assert linear.streamed_rows == 0
    with torch.inference_mode():
        assert linear(torch.randn(0, 8)).shape == (0, 4)
