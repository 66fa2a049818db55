"""Weight quantization formats: one registry, each format a quantize/dequantize pair.

A format turns one ``[N, K]`` weight into the tensors a compressed-tensors checkpoint stores
for it (suffix -> tensor: ``weight``, ``weight_scale``, ...) and back into a float32 weight.
The matmul runs in the model's compute dtype on the dequantized weight, unless the engine keeps
8-bit weights (``--quantization``, kernels.quantized_linear: int8-channel on CPU and CUDA);
each format's ``native`` says where hardware supports it.

NVFP4 is emulated exactly as the format defines it: e2m1 values {0, .5, 1, 1.5, 2, 3, 4, 6}
(round to nearest, ties to the even code), blocks of 16 along K, one e4m3 scale per block
relative to an fp32 global scale g = amax / (6 * 448). compressed-tensors stores the
reciprocal 1/g as ``weight_global_scale`` (its convention; vLLM divides by it), so we do too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.quantized_linear import MIN_SCALE, quantize_int8_weight
from kvmesh.checkpoint.format_names import FORMAT_NAMES

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
# The e2m1 magnitudes by code (the low 3 bits; bit 3 is the sign). Even codes have mantissa 0.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Format:
    name: str
    bits: float  # stored bits per weight, scales included
    ct_format: str  # compressed-tensors "format" of the checkpoint
    ct_weights: dict[str, Any]  # compressed-tensors QuantizationArgs of the weights
    quantize: Callable[[torch.Tensor], Tensors]
    dequantize: Callable[[Tensors], torch.Tensor]  # -> float32 [N, K]
    native: str  # where the matmul runs natively


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _fp8_tensor_q(weight: torch.Tensor) -> Tensors:
    w = weight.float()
    scale = (w.abs().amax() / FP8_MAX).clamp_min(MIN_SCALE).reshape(1)
    return {"weight": _fp8(w, scale), "weight_scale": scale}


def _fp8_channel_q(weight: torch.Tensor) -> Tensors:
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return {"weight": _fp8(w, scale), "weight_scale": scale}


def _scaled_dq(t: Tensors) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"].float()


def _int8_channel_q(weight: torch.Tensor) -> Tensors:
    qweight, scale = quantize_int8_weight(weight)  # the kernels' own int8 weights, so served == stored
    return {"weight": qweight, "weight_scale": scale.unsqueeze(1)}


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit e2m1 codes (uint8, sign in bit 3): nearest value, ties to the even code,
    magnitudes past 6 saturate."""
    mag = x.abs().clamp(max=E2M1_MAX)
    values = E2M1_VALUES.to(x.device)
    dist = (mag.unsqueeze(-1) - values).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # Among equally near codes take the even one (mantissa bit 0): round-half-to-even.
    tied = dist == best
    even = tied & (torch.arange(8, device=x.device) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), tied.float().argmax(-1)).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    mag = E2M1_VALUES.to(code.device)[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] 4-bit codes -> [N, K/2] uint8, element 2i in the low nibble (compressed-tensors order)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _nvfp4_q(weight: torch.Tensor) -> Tensors:
    w = weight.float()
    n, k = w.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs K divisible by {NVFP4_BLOCK}, got {k}")
    g = (w.abs().amax() / (E2M1_MAX * FP8_MAX)).clamp_min(MIN_SCALE)
    blocks = w.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale = (blocks.abs().amax(-1) / (E2M1_MAX * g)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    # The block's effective scale is what dequantization will use: the e4m3-rounded one.
    eff = block_scale.float() * g
    scaled = torch.where(eff[..., None] > 0, blocks / eff[..., None].clamp_min(MIN_SCALE), torch.zeros_like(blocks))
    codes = e2m1_encode(scaled.reshape(n, k))
    return {"weight_packed": _pack(codes), "weight_scale": block_scale, "weight_global_scale": (1.0 / g).reshape(1)}


def _nvfp4_dq(t: Tensors) -> torch.Tensor:
    values = e2m1_decode(_unpack(t["weight_packed"]))
    n, k = values.shape
    scale = t["weight_scale"].float() / t["weight_global_scale"].float()
    return (values.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK) * scale[..., None]).reshape(n, k)


def _weights_args(num_bits: int, kind: str, strategy: str, **extra: Any) -> dict[str, Any]:
    return {"num_bits": num_bits, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False, **extra}


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp8-tensor", 8.0, "float-quantized", _weights_args(8, "float", "tensor"),
               _fp8_tensor_q, _scaled_dq, "Hopper/Ada (sm89+) fp8 tensor cores; Triton fp8 kernel here on CUDA"),
        Format("fp8-channel", 8.0, "float-quantized", _weights_args(8, "float", "channel"),
               _fp8_channel_q, _scaled_dq, "Hopper/Ada (sm89+) fp8 tensor cores; Triton fp8 kernel here on CUDA"),
        Format("int8-channel", 8.0, "int-quantized", _weights_args(8, "int", "channel"),
               _int8_channel_q, _scaled_dq, "int8 tensor cores on Turing+ (sm75+); weight-only via Marlin/Machete"),
        Format("nvfp4", 4.0 + 8.0 / NVFP4_BLOCK, "nvfp4-pack-quantized",
               _weights_args(4, "float", "tensor_group", group_size=NVFP4_BLOCK),
               _nvfp4_q, _nvfp4_dq, "Blackwell (sm100+) fp4 tensor cores; weight-only FP4 Marlin on Ampere+"),
    )
}  # fmt: skip
assert tuple(FORMATS) == FORMAT_NAMES, "kvmesh/checkpoint/format_names.py names other formats"
UNQUANTIZED_BITS = 16.0


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown quantization format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def fake_quantize(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight the quantized model computes with: quantize then dequantize, in weight's dtype."""
    fmt = get_format(name)
    return fmt.dequantize(fmt.quantize(weight)).to(weight.dtype)
