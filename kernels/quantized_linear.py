"""Weight-only quantized linear layers for ``--quantization fp8|int8``.

``quantize_model(model, scheme)`` swaps every ``nn.Linear`` of a loaded model (the LM head
excepted) for a ``QuantizedLinear``: its weight is quantized once to 8 bits with one scale
per output channel, and each forward runs the scaled matmul (activations in the model's
dtype × 8-bit weights, float32 accumulation) through the dispatcher. Half the weight bytes
of bf16, which is what bounds decode.

- ``fp8``: e4m3 weights; CUDA only (the Triton kernel; the CPU has no fp8 arithmetic).
- ``int8``: int8 weights, exactly the ``int8-channel`` format of ``kvmesh quantize``, which is
  ``quantize_int8_weight`` (``kvmesh.checkpoint.formats`` uses it; its fidelity report measures what it
  costs). CUDA runs the Triton kernel; the CPU runs ``kernels.cpu``'s AVX-512 kernel, built on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from kernels.dispatch import get_op
from kernels.errors import KernelUnavailable, UnknownScheme
from kernels.module_swap import swap_modules

# The output projection is kept in 16 bits by common recipes (its errors go straight into the
# logits); the engine quantizes it only when asked (CausalLM.quantize).
DEFAULT_SKIP = ("lm_head",)
INT8_MAX = 127.0
# An all-zero row's scale, so quantizing never divides by zero.
MIN_SCALE = 1e-12


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scale [N]): symmetric, one scale per output channel (row),
    rounded to nearest. The int8-channel checkpoint format (kvmesh.checkpoint.formats) stores exactly these."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min(MIN_SCALE)
    qweight = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight.contiguous(), scale.reshape(-1).contiguous()


def _load_cpu_kernels() -> None:
    from kernels import cpu

    cpu.load()  # KernelUnavailable, with the reason, where they cannot run


@dataclass(frozen=True)
class Scheme:
    name: str
    # (weight [N, K], its device) -> (8-bit qweight [N, K], float32 scale [N])
    quantize: Callable[[torch.Tensor, torch.device], tuple[torch.Tensor, torch.Tensor]]
    matmul_op: str  # the dispatcher's op: (x, qweight, scale, bias) -> x @ (qweight · scale)ᵀ + bias
    # device type -> what must hold before the op can run there (raises KernelUnavailable)
    prepare: dict[str, Callable[[], None]]


def _no_preparation() -> None:
    return None


SCHEMES = {
    "fp8": Scheme(
        "fp8", lambda w, device: get_op("quantize_fp8_weight", device)(w), "fp8_scaled_mm",
        {"cuda": _no_preparation},
    ),
    "int8": Scheme(
        "int8", lambda w, device: quantize_int8_weight(w), "int8_scaled_mm",
        {"cuda": _no_preparation, "cpu": _load_cpu_kernels},
    ),
}  # fmt: skip


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise UnknownScheme(f"unknown quantization {name!r}; supported: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def _prepare(scheme: Scheme, device: torch.device) -> None:
    if device.type not in scheme.prepare:
        where = " or ".join(d.upper() if d == "cpu" else f"a {d.upper()} GPU" for d in scheme.prepare)
        raise KernelUnavailable(f"{scheme.name} quantization needs {where}; this model is on {device.type}")
    scheme.prepare[device.type]()


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is stored as 8-bit values plus per-output-channel scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme) -> None:
        super().__init__()
        device = weight.device
        _prepare(scheme, device)
        self.scheme = scheme.name
        self.out_features, self.in_features = weight.shape
        qweight, scale = scheme.quantize(weight.detach(), device)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach())
        self._scaled_mm = get_op(scheme.matmul_op, device)

    @classmethod
    def of(cls, linear: nn.Linear, scheme: Scheme) -> QuantizedLinear:
        return cls(linear.weight, linear.bias, scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._scaled_mm(rows, self.qweight, self.scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme}"
        )


def quantize_model(model: nn.Module, scheme: str, skip: Collection[str] = DEFAULT_SKIP) -> int:
    """Replace, in place, every ``nn.Linear`` in ``model`` whose last name component is not in
    ``skip`` with a ``QuantizedLinear`` of ``scheme``; returns how many were replaced. Call it
    on the loaded model, already on its device, and cast the model no more after it
    (``.to(dtype)`` would widen the 8-bit buffers). Raises KernelUnavailable (before any
    weight is touched) where the scheme cannot run on the model's device."""
    chosen = get_scheme(scheme)
    devices = {p.device for p in model.parameters()}
    for device in devices:
        _prepare(chosen, device)
    return swap_modules(
        model,
        lambda name, m: isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in skip,
        lambda linear: QuantizedLinear.of(linear, chosen),
    )
