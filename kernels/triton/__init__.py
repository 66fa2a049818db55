"""Triton implementations of the ops in ``kernels.dispatch.OPS``, registered on import.

Import this package with ``TRITON_INTERPRET=1`` already set to get interpreted
kernels (CPU tests): Triton decides between compiling and interpreting when each
kernel is defined, not when it runs.
"""

from kernels.dispatch import register_triton
from kernels.triton.decode_attention import paged_decode_attention
from kernels.triton.extend_attention import paged_extend_attention
from kernels.triton.fp8 import fp8_scaled_mm, int8_scaled_mm, quantize_fp8_weight
from kernels.triton.kv_write import write_kv_cache
from kernels.triton.lora import lora_add
from kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from kernels.triton.rotary import rotary_embedding
from kernels.triton.silu_mul import silu_and_mul

KERNELS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_embedding": rotary_embedding,
    "write_kv_cache": write_kv_cache,
    "paged_decode_attention": paged_decode_attention,
    "paged_extend_attention": paged_extend_attention,
    "quantize_fp8_weight": quantize_fp8_weight,
    "fp8_scaled_mm": fp8_scaled_mm,
    "int8_scaled_mm": int8_scaled_mm,
    "lora_add": lora_add,
}

for _name, _fn in KERNELS.items():
    register_triton(_name, _fn)
