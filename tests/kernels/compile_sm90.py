"""Compile every Triton kernel, through its real wrapper and launch configuration, for a
Hopper GPU (sm_90) on a machine without one, and print one JSON line per kernel with its
shared memory, registers, and stack and local (spill) bytes. Catches kernels the
interpreter accepts but the compiler rejects, and tiles that would not fit, before a
GPU is at hand.

Run as a script in a process where TRITON_INTERPRET is unset (the test does so).
How: a stand-in driver names sm_90 as the current target, and Triton's pre-compile
hook compiles each kernel itself and tells Triton to skip the launch.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class _HopperStandIn:
    """Just enough of a Triton driver for the JIT to specialize and compile for sm_90."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack/local bytes (spills) of the compiled kernel, from cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        report = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    return {key.lower(): int(re.search(rf"\b{key}:(\d+)", report).group(1)) for key in ("REG", "STACK", "LOCAL")}


def _compile_instead_of_launch(results: list[dict[str, Any]], calling: list[str]) -> Callable[..., bool]:
    def hook(*, fn, compile, **_: Any) -> bool:
        src = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
        options = {"num_warps": compile["num_warps"], "num_stages": compile["num_stages"]}
        kernel = triton.compile(src, target=HOPPER, options=options)
        results.append({
            "op": calling[0],
            "kernel": fn.name,
            "num_warps": compile["num_warps"],
            "num_stages": compile["num_stages"],
            "shared_bytes": kernel.metadata.shared,
            "tensor_core_ops": sorted(set(re.findall(r"\b(wgmma\.mma_async|mma\.sync)\b", kernel.asm["ptx"]))),
            **_resource_usage(kernel.asm["cubin"]),
        })  # fmt: skip
        return True  # compiled here: tell Triton not to launch

    return hook


def _engine_like_calls() -> list[tuple[str, Callable[[], object]]]:
    """Each wrapper with engine-like bf16 shapes (Llama-3-8B heads), so the launch
    configurations compiled are the ones a GPU would run."""
    from kernels.triton import KERNELS as K

    bf16, t, hq, hk, d = torch.bfloat16, 300, 32, 8, 128
    x, ones = torch.randn(t, 4096, dtype=bf16), torch.ones(4096, dtype=bf16)
    q, k = torch.randn(t, hq, d, dtype=bf16), torch.randn(t, hk, d, dtype=bf16)
    cache = torch.zeros(64, 16, hk, d, dtype=bf16)
    tables, lens = torch.zeros(2, 64, dtype=torch.long), torch.tensor([150, 1000])
    qweight, scale = torch.zeros(512, 4096, dtype=torch.float8_e4m3fn), torch.ones(512)
    int8_weight = torch.zeros(512, 4096, dtype=torch.int8)
    # A fused qkv projection's LoRA: 4 slots of width 3 x rank 16, three adapters' runs and base rows.
    from kernels.lora_segments import LoraSegments

    segments = LoraSegments.build([(0, 100), (-1, 50), (2, 120), (1, 30)], torch.device("cpu"))
    lora_a, lora_b = torch.zeros(4, 48, 4096, dtype=bf16), torch.zeros(4, 48, 6144, dtype=bf16)
    lora_y = torch.zeros(t, 6144, dtype=bf16)
    # Qwen3-30B-A3B's routed experts (768 x 2048, 8 per token); 4 stand in for its 128: the count compiles nothing.
    moe_ids, moe_weights = torch.randint(0, 4, (t, 8)), torch.rand(t, 8)
    moe_gate_up, moe_down = torch.zeros(4, 2 * 768, 2048, dtype=bf16), torch.zeros(4, 2048, 768, dtype=bf16)
    moe_x = torch.randn(t, 2048, dtype=bf16)
    # DeepSeek-V3's latent rows (512 + 64); its 128 heads whole, and per rank at TP4 and TP8 (each head
    # count picks its own head block), and float32.
    latent = torch.zeros(64, 16, 1, 576, dtype=bf16)
    mla_q = torch.randn(2, 128, 576, dtype=bf16)
    return [
        ("rms_norm", lambda: K["rms_norm"](x, ones, 1e-6)),
        ("fused_add_rms_norm", lambda: K["fused_add_rms_norm"](x, x, ones, 1e-6)),
        ("silu_and_mul", lambda: K["silu_and_mul"](torch.randn(t, 2 * 14336, dtype=bf16))),
        ("gelu_tanh_and_mul", lambda: K["gelu_tanh_and_mul"](torch.randn(t, 2 * 14336, dtype=bf16))),
        ("moe_experts", lambda: K["moe_experts"](moe_x, moe_ids, moe_weights, moe_gate_up, moe_down, "silu")),
        ("moe_experts gelu_tanh",
         lambda: K["moe_experts"](moe_x, moe_ids, moe_weights, moe_gate_up, moe_down, "gelu_tanh")),
        ("moe_experts float32",
         lambda: K["moe_experts"](moe_x.float(), moe_ids, moe_weights, moe_gate_up.float(), moe_down.float(), "silu")),
        ("rotary_embedding", lambda: K["rotary_embedding"](torch.arange(t), q, k, torch.randn(4096, d))),
        ("write_kv_cache", lambda: K["write_kv_cache"](k, k, cache, cache, torch.arange(t))),
        ("paged_decode_attention", lambda: K["paged_decode_attention"](q[:2], cache, cache, tables, lens, 0.1)),
        ("paged_extend_attention",
         lambda: K["paged_extend_attention"](q, cache, cache, tables, torch.tensor([0, 100, t]), lens, 0.1)),
        # Sliding windows: the decode kernels take the window as an argument, the extend kernel compiles
        # a second (WINDOWED) variant with the masked leading tiles.
        ("paged_decode_attention window",
         lambda: K["paged_decode_attention"](q[:2], cache, cache, tables, lens, 0.1, 4096)),
        ("paged_extend_attention window",
         lambda: K["paged_extend_attention"](q, cache, cache, tables, torch.tensor([0, 100, t]), lens, 0.1, 4096)),
        ("mla_decode_attention", lambda: K["mla_decode_attention"](mla_q, latent, tables, lens, 0.1, 512)),
        ("mla_decode_attention H=32", lambda: K["mla_decode_attention"](mla_q[:, :32], latent, tables, lens, 0.1, 512)),
        ("mla_decode_attention H=16", lambda: K["mla_decode_attention"](mla_q[:, :16], latent, tables, lens, 0.1, 512)),
        ("mla_decode_attention float32",
         lambda: K["mla_decode_attention"](mla_q.float(), latent.float(), tables, lens, 0.1, 512)),
        ("quantize_fp8_weight", lambda: K["quantize_fp8_weight"](torch.randn(512, 4096, dtype=bf16))),
        ("fp8_scaled_mm", lambda: K["fp8_scaled_mm"](torch.randn(16, 4096, dtype=bf16), qweight, scale)),  # decode
        ("fp8_scaled_mm", lambda: K["fp8_scaled_mm"](torch.randn(4096, 4096, dtype=bf16), qweight, scale)),  # prefill
        ("int8_scaled_mm", lambda: K["int8_scaled_mm"](torch.randn(16, 4096, dtype=bf16), int8_weight, scale)),
        ("int8_scaled_mm", lambda: K["int8_scaled_mm"](torch.randn(4096, 4096, dtype=bf16), int8_weight, scale)),
        ("lora_add", lambda: K["lora_add"](lora_y, x[:, :4096], lora_a, lora_b, segments)),
        # Deterministic serving's one fixed tile: a decode step's bf16 rows, and float32 (IEEE dots) with a bias.
        ("invariant_mm", lambda: K["invariant_mm"](x[:16], torch.zeros(512, 4096, dtype=bf16))),
        ("invariant_mm", lambda: K["invariant_mm"](torch.randn(t, 4096), torch.zeros(512, 4096), torch.zeros(512))),
    ] + [  # attention and the matmul with wider rows, whose tiles must shrink to fit shared memory
        (f"{op} {dtype} D={dim}", call)
        for dtype, dim in ((torch.float32, 128), (torch.bfloat16, 256), (torch.float32, 256))
        for op, call in _wide_row_calls(K, dtype, dim)
    ]  # fmt: skip


def _wide_row_calls(K: dict, dtype: torch.dtype, d: int) -> list[tuple[str, Callable[[], object]]]:
    q, cache = torch.randn(300, 8, d, dtype=dtype), torch.zeros(64, 16, 2, d, dtype=dtype)
    tables, lens = torch.zeros(2, 64, dtype=torch.long), torch.tensor([150, 1000])
    x, qweight = torch.randn(4096, 512, dtype=dtype), torch.zeros(512, 512, dtype=torch.float8_e4m3fn)
    return [
        ("paged_decode_attention", lambda: K["paged_decode_attention"](q[:2], cache, cache, tables, lens, 0.1)),
        ("paged_extend_attention",
         lambda: K["paged_extend_attention"](q, cache, cache, tables, torch.tensor([0, 100, 300]), lens, 0.1)),
        ("paged_extend_attention window",
         lambda: K["paged_extend_attention"](q, cache, cache, tables, torch.tensor([0, 100, 300]), lens, 0.1, 4096)),
        ("fp8_scaled_mm", lambda: K["fp8_scaled_mm"](x, qweight, torch.ones(512))),
    ]  # fmt: skip


def main() -> None:
    results: list[dict[str, Any]] = []
    calling = [""]
    triton.runtime.driver.set_active(_HopperStandIn())
    triton.knobs.runtime.jit_cache_hook = _compile_instead_of_launch(results, calling)
    for op, call in _engine_like_calls():
        calling[0] = op
        call()
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
