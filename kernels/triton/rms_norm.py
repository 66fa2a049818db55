"""RMSNorm and fused residual-add + RMSNorm: one program per row, the whole row in registers.

Rounding follows ``kernels.reference``: the residual sum and the normalized row are
rounded to the input dtype before the weight multiply, as Hugging Face does.
Rows may be strided over two leading dims (q/k-norm reads heads out of the fused
qkv projection without a copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._validate import check_same_device, check_tensor, require


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    rows_per_outer,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // rows_per_outer, row % rows_per_outer
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows per outer index, outer stride, inner stride) for a 2-D or 3-D tensor of rows."""
    if t.dim() == 2:
        return 1, t.stride(0), 0
    return t.shape[1], t.stride(0), t.stride(1)


def _num_warps(block: int) -> int:
    # About 8 elements (16 bytes of bf16) per thread, between 1 and 8 warps.
    return max(1, min(8, block // 256))


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_tensor("x", x, (2, 3))
    check_tensor("weight", weight, 1)
    hidden = x.shape[-1]
    require(weight.shape[0] == hidden, f"weight has {weight.shape[0]} elements, x rows have {hidden}")
    require(weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor("residual", residual, x.dim())
        require(residual.shape == x.shape, f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        require(residual.dtype == x.dtype, f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
        tensors["residual"] = residual
    check_same_device(**tensors)

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty_like(out)
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return out, residual_out
    per_outer, sx0, sx1 = _row_layout(x)
    _, sr0, sr1 = _row_layout(residual) if residual is not None else (1, 0, 0)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, residual_out if residual_out is not None else out,
        per_outer, sx0, sx1, sr0, sr1, hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
    )  # fmt: skip
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] or [T, heads, H] (last dim contiguous) -> contiguous, same shape and dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) from one pass over the row."""
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
