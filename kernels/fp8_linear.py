"""FP8 weight-only linear layers for ``--quantization fp8`` (CUDA only).

``quantize_model_fp8(model)`` swaps every ``nn.Linear`` of a loaded model for an
``Fp8Linear``: the weight is quantized once to e4m3 with one scale per output
channel, and each forward runs the scaled matmul (16-bit activations × fp8
weights) through the dispatcher. Half the weight bytes of bf16, which is what
bounds decode.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from kernels.dispatch import get_op
from kernels.module_swap import swap_modules
from kvmesh.errors import FailedPrecondition

# The output projection is read as a raw weight by the model (and kept in 16 bits by
# common fp8 recipes: its errors go straight into the logits).
DEFAULT_SKIP = ("lm_head",)


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is stored as float8_e4m3fn plus per-output-channel scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        device = linear.weight.device
        if device.type != "cuda":
            raise FailedPrecondition("fp8 quantization needs a CUDA GPU")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = get_op("quantize_fp8_weight", device)(linear.weight.detach())
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self._scaled_mm = get_op("fp8_scaled_mm", device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._scaled_mm(rows, self.qweight, self.scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_model_fp8(model: nn.Module, skip: Collection[str] = DEFAULT_SKIP) -> int:
    """Replace, in place, every ``nn.Linear`` in ``model`` whose last name component is not in
    ``skip`` with an ``Fp8Linear``; returns how many were replaced. Call it on the loaded model,
    already on its CUDA device, and cast the model no more after it (``.to(dtype)`` would
    widen the fp8 buffers). Raises FailedPrecondition unless every parameter is on CUDA."""
    if any(p.device.type != "cuda" for p in model.parameters()):
        raise FailedPrecondition("fp8 quantization needs a CUDA GPU")
    return swap_modules(
        model, lambda name, m: isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in skip, Fp8Linear
    )
