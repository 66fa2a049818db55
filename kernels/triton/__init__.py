"""Triton implementations of the ops in ``kernels.dispatch.OPS``, registered on import.

Import this package with ``TRITON_INTERPRET=1`` already set to get interpreted
kernels (CPU tests): Triton decides between compiling and interpreting when each
kernel is defined, not when it runs.
"""

from functools import partial

from kernels.dispatch import register_triton, register_triton_invariant
from kernels.rows_as_decodes import every_row_as_decode
from kernels.triton.decode_attention import paged_decode_attention
from kernels.triton.extend_attention import paged_extend_attention
from kernels.triton.fp8 import fp8_scaled_mm, int8_scaled_mm, quantize_fp8_weight
from kernels.triton.fused_moe import moe_experts
from kernels.triton.invariant_mm import invariant_mm
from kernels.triton.kv_write import write_kv_cache
from kernels.triton.lora import lora_add
from kernels.triton.mla_decode import mla_decode_attention
from kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from kernels.triton.rotary import rotary_embedding
from kernels.triton.silu_mul import gelu_tanh_and_mul, silu_and_mul

KERNELS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "rotary_embedding": rotary_embedding,
    "write_kv_cache": write_kv_cache,
    "paged_decode_attention": paged_decode_attention,
    "paged_extend_attention": paged_extend_attention,
    "mla_decode_attention": mla_decode_attention,
    "quantize_fp8_weight": quantize_fp8_weight,
    "fp8_scaled_mm": fp8_scaled_mm,
    "int8_scaled_mm": int8_scaled_mm,
    "lora_add": lora_add,
    "invariant_mm": invariant_mm,
    "moe_experts": moe_experts,
}
# Batch-invariant forms, where the kernel above depends on the batch: the extend kernel's tiles
# round a row otherwise than the decode kernel does, so deterministic serving decodes every row.
INVARIANT_KERNELS = {"paged_extend_attention": partial(every_row_as_decode, paged_decode_attention)}

for _name, _fn in KERNELS.items():
    register_triton(_name, _fn)
for _name, _fn in INVARIANT_KERNELS.items():
    register_triton_invariant(_name, _fn)
