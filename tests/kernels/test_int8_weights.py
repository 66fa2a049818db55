"""int8 weights: the native CPU kernel (kernels/cpu, built on first use) and the Triton matmul
(interpreted) against the reference, the kernel's batch invariance, its tracing by
torch.compile, the layer swap, and the refusals where the kernel cannot run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu, dispatch, get_op, reference
from kernels.errors import KernelUnavailable, UnknownScheme
from kernels.quantized_linear import SCHEMES, QuantizedLinear, quantize_int8_weight, quantize_model
from kernels.triton.fp8 import int8_scaled_mm as triton_int8_scaled_mm
from kernels.triton.testing import poisoned_allocations, relative_error
from tests.kernels.native import native_cpu_kernels

CPU = torch.device("cpu")


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch):
    """The native CPU op, picked by the dispatcher (outside the interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    native_cpu_kernels()
    op = get_op("int8_scaled_mm", CPU)
    assert op is torch.ops.kvmesh_cpu.int8_scaled_mm
    return op


def test_quantization_is_the_int8_channel_format() -> None:
    weight = torch.randn(40, 70) * torch.logspace(-2, 1, 40)[:, None]
    weight[3] = 0
    q, scale = quantize_int8_weight(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (40,)
    assert torch.equal(scale[4:], weight[4:].abs().amax(1) / 127)
    assert torch.equal(q.abs().amax(1)[4:], torch.full((36,), 127, dtype=torch.int8))
    assert torch.equal(q[3], torch.zeros(70, dtype=torch.int8))
    assert torch.all((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 * (1 + 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 33, 40])  # passes of 1-6 rows; past 32 the widened GEMM
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_kernel_matches_reference(native, dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    n, k = 203, 200  # neither a multiple of the 4-row weight blocks nor of 16 columns
    q, scale = quantize_int8_weight(torch.randn(n, k))
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    out = native(x, q, scale, bias)
    ref = reference.int8_scaled_mm(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (rows, n)
    # float32: summation order only; 16 bits: the output's rounding (and past 32 rows, the widened weight's).
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert (
        relative_error(out, reference.int8_scaled_mm(x.float(), q, scale, None if bias is None else bias.float())) < tol
    )
    assert relative_error(out, ref) < tol


def test_native_kernel_rows_do_not_depend_on_their_batch(native) -> None:
    """A verify's k + 1 rows get bit for bit what each row gets alone (up to the streamed limit)."""
    q, scale = quantize_int8_weight(torch.randn(300, 576))
    x = torch.randn(32, 576, dtype=torch.bfloat16)
    alone = torch.cat([native(x[i : i + 1], q, scale) for i in range(32)])
    for rows in (2, 3, 5, 6, 7, 16, 32):
        assert torch.equal(native(x[:rows], q, scale), alone[:rows])


def test_native_kernel_widens_the_weight_exactly_past_the_streamed_rows(native) -> None:
    """Past 32 rows the weight is widened to x's dtype (rounded to nearest even) for the GEMM."""
    q, scale = quantize_int8_weight(torch.randn(40, 35))  # 35: a tail after two 16-wide vectors
    eye = torch.eye(35)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        widened = native(eye.to(dtype), q, scale).t()  # x = I: the product is the widened weight
        assert torch.equal(widened, (q.float() * scale[:, None]).to(dtype))


def test_native_kernel_rejects_bad_shapes(native) -> None:
    q, scale = quantize_int8_weight(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="x has 15 columns, qweight 16"):
        native(torch.randn(1, 15), q, scale)
    with pytest.raises(RuntimeError, match="scale must be 8 contiguous float32 values"):
        native(torch.randn(1, 16), q, scale.double())
    with pytest.raises(RuntimeError, match="qweight must be a contiguous 2-D int8 tensor"):
        native(torch.randn(1, 16), q.float(), scale)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16, not Double"):
        native(torch.randn(1, 16, dtype=torch.float64), q, scale)


def test_native_kernel_under_torch_compile(native) -> None:
    q, scale = quantize_int8_weight(torch.randn(64, 96))
    bias = torch.randn(64)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(native(x * 2, q, scale, bias))

    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for rows in (1, 3):
        x = torch.randn(rows, 96)
        assert torch.equal(compiled(x), layer(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 70])
def test_triton_int8_matmul_matches_reference(dtype: torch.dtype, rows: int) -> None:
    q, scale = quantize_int8_weight(torch.randn(200, 300))
    x = torch.randn(rows, 300).to(dtype)
    bias = torch.randn(200).to(dtype)
    with poisoned_allocations():
        out = triton_int8_scaled_mm(x, q, scale, bias)
    assert out.dtype == dtype
    ref = reference.int8_scaled_mm(x.float(), q, scale, bias.float())
    assert relative_error(out, ref) < {torch.float32: 1e-5, torch.float16: 1e-3}[dtype]


def test_quantize_model_swaps_every_linear_but_the_head(native) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"up": nn.Linear(32, 64), "down": nn.Linear(64, 32, bias=False), "lm_head": nn.Linear(32, 10)}
    )
    x = torch.randn(3, 32)
    with torch.no_grad():
        before = model["down"](torch.relu(model["up"](x)))
        assert quantize_model(model, "int8") == 2
        after = model["down"](torch.relu(model["up"](x)))
    assert isinstance(model["up"], QuantizedLinear) and type(model["lm_head"]) is nn.Linear
    assert model["up"].qweight.dtype == torch.int8 and "scheme=int8" in repr(model["up"])
    assert relative_error(after, before) < 0.02  # the int8 rounding of two layers


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(UnknownScheme, match="unknown quantization 'int4'; supported: fp8, int8"):
        quantize_model(nn.Linear(4, 4), "int4")


def test_a_cpu_without_avx512_gets_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_loaded", False)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    model = nn.Sequential(nn.Linear(8, 8))
    for _ in range(2):  # the reason is kept: the second call raises it without trying again
        with pytest.raises(
            KernelUnavailable, match=r"native CPU kernels are unavailable: they need AVX-512 \(torch reports AVX2"
        ):
            quantize_model(model, "int8")
    assert type(model[0]) is nn.Linear
    with pytest.raises(KernelUnavailable, match="unavailable"):
        QuantizedLinear.of(nn.Linear(8, 8), SCHEMES["int8"])


def test_a_failed_build_gets_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    def no_compiler(**_: object) -> None:
        raise RuntimeError("Error building extension 'kvmesh_cpu'\nc++: not found")

    monkeypatch.setattr(cpu, "_loaded", False)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setattr(dispatch, "_CPU_NATIVE", {})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # the build is tried anywhere
    with pytest.raises(KernelUnavailable, match="unavailable: RuntimeError: c\\+\\+: not found"):
        cpu.load()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert get_op("int8_scaled_mm", CPU) is reference.int8_scaled_mm  # nothing registered
