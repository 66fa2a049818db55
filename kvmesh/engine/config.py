"""The engine's configuration (``EngineConfig``: the knobs of one engine) and its dtypes.

What a model folder's ``config.json`` says is ``kvmesh.checkpoint.model_config.ModelConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.small_rows_linear import small_rows_dtypes
from kvmesh.blocks import DEFAULT_BLOCK_SIZE
from kvmesh.errors import InvalidArgument

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# How tensor-parallel ranks may sum their partial products (``EngineConfig.tp_all_reduce``).
TP_ALL_REDUCES = ("shm", "gloo", "nccl")


@dataclass
class EngineConfig:
    """Knobs of one engine instance. Defaults suit a small model on CPU."""

    device: str = "cpu"
    # None: the checkpoint's dtype on CUDA, float32 on CPU (CPU bf16 matmul is slow and lossy).
    dtype: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 512
    max_num_seqs: int = 64
    # Token budget of one step: decodes take 1 each, prefills are chunked to fit.
    max_num_batched_tokens: int = 512
    # Context limit; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    # Weight-only 8-bit weights with per-channel scales (kernels.quantized_linear): "fp8" (CUDA)
    # or "int8" (CUDA, or CPU with AVX-512); None: the weights in the model's dtype.
    quantization: str | None = None
    # With a quantization: the LM head's product in 8 bits too (the embedding lookup keeps the
    # checkpoint's weights). Off by default: its errors go straight into the logits.
    quantize_lm_head: bool = False
    # Run few-row products (up to 64 rows: decode steps, verifies) on oneDNN-reordered copies of
    # the weights (kernels.small_rows_linear; CPU, float32 and bfloat16). Costs a second copy of
    # the weights; False keeps only the checkpoint's (MKL's products).
    small_rows_linears: bool = True
    seed: int = 0
    # torch.compile the decode step's layers (kvmesh.engine.compile): start-up pays the compile.
    compile: bool = False
    # Deterministic serving (docs/determinism.md): every op in a batch-invariant form, so a
    # request's tokens and logprobs are the same bits whatever it is batched with, however its
    # prompt was chunked or cached, wherever it was prefilled. Runs the decode step eagerly
    # (``compile`` is ignored) and without the small-row linears; native kernels on CPU, Triton ones
    # on CUDA; not with a quantization.
    deterministic: bool = False
    # Ranks (processes) one engine's model is split over (kvmesh.engine.tensor_parallel): rank 0 is
    # this process; on CUDA rank r runs on the r-th GPU from ``device``. One machine.
    tensor_parallel_size: int = 1
    # A Mixture-of-Experts model over those ranks: each rank holds 1/N of the experts, whole (expert
    # parallelism), instead of 1/N of every expert's columns. Attention is split by heads either way.
    expert_parallel: bool = False
    # How the ranks sum their partial products: "shm" (shared memory, CPU ranks), "gloo" (a
    # torch.distributed group over TCP, CPU ranks) or "nccl" (CUDA ranks); None: shm on CPU, nccl on CUDA.
    tp_all_reduce: str | None = None
    # LoRA adapters resident at once (kvmesh.engine.lora; more can be loaded, in host memory), and
    # the highest rank one may have; 0 adapters: LoRA off.
    max_loras: int = 4
    max_lora_rank: int = 16
    # Fault injection (tests, chaos drills): the step loop fails, with a failure no request owns,
    # once this many steps ran (0: never). docs/faults.md says what a worker then does.
    fault_after_steps: int = 0

    def wants_small_rows_linears(self, dtype: torch.dtype) -> bool:
        return (
            self.small_rows_linears and self.device == "cpu" and dtype in small_rows_dtypes() and not self.deterministic
        )

    def compiles(self) -> bool:
        """Whether the decode step runs compiled: asked for, and not deterministic (whose batch-invariant
        ops inductor would fuse into code of its own)."""
        return self.compile and not self.deterministic

    def resolve_tp_all_reduce(self) -> str:
        """The ranks' all-reduce (``tp_all_reduce``, or the device's default); InvalidArgument where the
        device cannot use the one asked for."""
        cuda = self.device.startswith("cuda")
        chosen = self.tp_all_reduce or ("nccl" if cuda else "shm")
        fits = ("nccl",) if cuda else ("shm", "gloo")
        if chosen not in fits:
            raise InvalidArgument(
                f"tensor-parallel all-reduce {chosen!r} does not run on {self.device} ranks (one of {', '.join(fits)})"
            )
        return chosen

    def resolve_max_model_len(self, model_max_positions: int) -> int:
        """The context limit to run with: the configured one, never past the model's positions."""
        return min(self.max_model_len or model_max_positions, model_max_positions)

    def resolve_dtype(self, model_dtype: str) -> torch.dtype:
        """The dtype to run in: the configured one; else the checkpoint's (``model_dtype``) on CUDA,
        float32 on CPU."""
        if self.dtype is not None:
            return parse_dtype(self.dtype)
        return parse_dtype(model_dtype) if self.device.startswith("cuda") else torch.float32
