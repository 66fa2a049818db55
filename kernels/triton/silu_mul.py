"""Gated MLP activations: x [..., 2d] holding gate then up -> act(gate) * up [..., d].

SiLU (Llama's SwiGLU) and GELU with the tanh approximation (Gemma's GeGLU): one jit kernel
per activation, one launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._validate import check_tensor

_MAX_BLOCK = 1024
_TWO_SQRT_2_OVER_PI = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x_row, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the storage dtype before the product, as the reference does.
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x_row, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    # gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), is g * sigmoid(2y): Triton has
    # no tanh the interpreter runs. The sigmoid is taken from exp(-|2y|), which never overflows (g^3 grows
    # fast) and does not cancel where 1 + tanh(y) would (large negative g). In float32 it is a few ulp from
    # torch's tanh form, so torch.equal with the reference is not promised even in float32.
    z = _TWO_SQRT_2_OVER_PI * (gate + _GELU_KAPPA * gate * gate * gate)
    e = tl.exp(-tl.abs(z))
    gelu = gate * (tl.where(z >= 0, 1.0, e) / (1.0 + e))
    # Round gelu(gate) to the storage dtype before the product, as the reference (and transformers'
    # ACT2FN["gelu_pytorch_tanh"](gate) * up) does in that dtype: two roundings, the same two as torch's,
    # so in bfloat16/float16 the outputs differ only where those few float32 ulp move a rounding, and in
    # the far negative tail (g < ~-3), where torch's 1 + tanh(y) has cancelled to a few ulp of 1.
    gelu = gelu.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (gelu * up).to(out_ptr.dtype.element_ty), mask=mask)


def _gated_and_mul(kernel: triton.JITFunction, x: torch.Tensor) -> torch.Tensor:
    check_tensor("x", x, tuple(range(1, 9)))
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"x's last dim must be even (gate then up), got {two_d}")
    d = two_d // 2
    rows = x.reshape(-1, two_d)  # a view for the usual [T, 2d] activations
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(triton.next_power_of_2(d), _MAX_BLOCK)
        grid = (rows.shape[0], triton.cdiv(d, block))
        kernel[grid](rows, out, rows.stride(0), d, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated_and_mul(_silu_and_mul_kernel, x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated_and_mul(_gelu_tanh_and_mul_kernel, x)
