"""The engine's flags, shared by every service that runs it (prefill, decode)."""

from __future__ import annotations

import argparse

from kernels.quantized_linear import SCHEMES as QUANTIZATION_SCHEMES
from kvmesh.engine.config import TP_ALL_REDUCES, EngineConfig
from kvmesh.models.sources import REVISION_HELP, ModelSource, resolve_source, served_name
from kvmesh.runtime import Flag

ENGINE_FLAGS = [
    Flag(
        "--model",
        "a local Hugging Face model folder, or a hub id (org/name) found in the Hugging Face cache, offline "
        "(default: the installed default model, SmolLM2-135M-Instruct)",
    ),
    Flag("--revision", REVISION_HELP),
    Flag("--device", "torch device, e.g. cuda:0 or cpu", default="cpu"),
    Flag("--dtype", "float32 | bfloat16 | float16 (default: checkpoint's on CUDA, float32 on CPU)"),
    Flag("--block-size", "tokens per KV block", default=16, type=int),
    Flag("--num-blocks", "KV blocks in this worker's pool", default=1024, type=int),
    Flag("--max-num-seqs", "sequences in the running batch at most", default=64, type=int),
    Flag("--max-num-batched-tokens", "token budget of one step (prefill chunk size)", default=512, type=int),
    Flag("--max-model-len", "context limit (default: the model's)", type=int),
    Flag(
        "--quantization",
        "8-bit weights, one scale per output channel: fp8 (CUDA) or int8 (CUDA, or a CPU with "
        "AVX-512: a kernel built on first use)",
        choices=tuple(QUANTIZATION_SCHEMES),
    ),
    Flag(
        "--quantize-lm-head",
        "with --quantization: the LM head's product in 8 bits too (docs/quantization.md measures what it costs)",
        default=False,
        type=bool,
    ),
    Flag(
        "--small-rows-linears",
        "CPU: decode and verify products on a oneDNN-reordered second copy of the weights, "
        "or streamed by kernels/cpu where that is faster (kernels/small_rows_linear.py; "
        "--no-small-rows-linears saves the memory)",
        default=True,
        type=bool,
    ),
    Flag(
        "--deterministic",
        "batch-invariant execution: a request's tokens and logprobs are the same bits whatever it is batched "
        "with, however its prompt was chunked, cached or handed off (CPU, or Triton on CUDA; the decode step runs "
        "eager; docs/determinism.md says what it covers and costs). Set it on every prefill and decode worker",
        default=False,
        type=bool,
    ),
    Flag(
        "--tensor-parallel-size",
        "split the model over this many processes (ranks) of this machine, Megatron-style: rank 0 serves, the "
        "others are its children (one machine; on CUDA rank r on the r-th GPU from --device; "
        "docs/tensor_parallel.md). Over NIXL each rank reads its own KV heads",
        default=1,
        type=int,
    ),
    Flag(
        "--enable-expert-parallel",
        "a Mixture-of-Experts model over the --tensor-parallel-size ranks holds 1/N of the experts whole on "
        "each rank (expert parallelism) instead of 1/N of every expert's columns; attention is split by heads "
        "either way (docs/moe.md)",
        default=False,
        type=bool,
    ),
    Flag(
        "--tp-all-reduce",
        "how tensor-parallel ranks sum their partial products: shm (shared memory) or gloo (torch.distributed "
        "over TCP) for CPU ranks, nccl for CUDA ranks; default: shm on CPU, nccl on CUDA",
        default=None,
        choices=TP_ALL_REDUCES,
    ),
    Flag(
        "--inject-engine-fault-after-steps",
        "fault injection (tests, chaos drills): the engine's step loop fails, with a failure no request owns, "
        "after this many steps (0: never); the worker then stops serving and exits (docs/faults.md)",
        default=0,
        type=int,
    ),
    Flag(
        "--lora",
        "LoRA adapters (PEFT folders) to load at start, NAME=PATH[,NAME=PATH...]; requests name one as their "
        "model, and more can be loaded at run time (the gateway's /v1/load_lora_adapter)",
        default=(),
        type=lambda text: parse_lora_specs(text),
    ),
    Flag(
        "--max-loras",
        "LoRA adapters resident at once (more stay loaded in host memory); 0: LoRA off",
        default=4,
        type=int,
    ),
    Flag("--max-lora-rank", "the highest rank an adapter may have", default=16, type=int),
    Flag("--worker-id", "this worker's id in the router (default: <role>-<host>:<port>)"),
    Flag("--router-address", "router host:port (unset: run without a router)"),
    Flag("--kvstore-address", "kvstore host:port: fetch cached prefixes from it, write new blocks to it (unset: none)"),
]


# Workers that decode: their decode steps run compiled graphs unless told otherwise. A prefill
# worker never runs a decode step, so it has no such flag.
COMPILE_FLAG = Flag(
    "--compile",
    "torch.compile the decode step (inductor, graphs kept in the compile cache, $KVMESH_COMPILE_CACHE): "
    "faster steps; the first start of a model and configuration compiles (minutes on CPU), later ones load "
    "from the cache; --no-compile runs eager (debugging)",
    default=True,
    type=bool,
)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        compile=getattr(args, "compile", False),
        small_rows_linears=args.small_rows_linears,
        deterministic=args.deterministic,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.enable_expert_parallel,
        tp_all_reduce=args.tp_all_reduce,
        fault_after_steps=args.inject_engine_fault_after_steps,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        **overrides,
    )


def parse_lora_specs(text: str) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH[,NAME=PATH...]`` as (name, path) pairs."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--lora wants NAME=PATH, got {item!r}")
        specs.append((name, path))
    return tuple(specs)


def model_source(args: argparse.Namespace) -> ModelSource:
    """``--model`` (+ ``--revision``) as a local folder: a folder, a hub id's snapshot in the HF cache, or the
    installed default model."""
    if args.model:
        return resolve_source(args.model, getattr(args, "revision", None))
    from kvmesh.engine.default_model import default_model_path

    return ModelSource(default_model_path())


def model_path(args: argparse.Namespace) -> str:
    """The folder the engine loads (``model_source``)."""
    return str(model_source(args).path)


def served_model_name(args: argparse.Namespace) -> str:
    """The name the model is served and labelled under: a hub id as given, else the folder's name (the
    gateway's default --model-name; ``served_name``, which never raises)."""
    return served_name(args.model) if args.model else model_source(args).name
