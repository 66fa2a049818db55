"""SiLU-and-mul: x [..., 2d] holding gate then up -> silu(gate) * up [..., d]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._validate import check_tensor

_MAX_BLOCK = 1024


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
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
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), d, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], d)
