"""OpenAI's ``system_fingerprint``: the serving configuration that produced a response.

It names what decides a response's bits beside the request and its seed: the model fingerprint
(weights, dtype, block size, quantization, and whether execution is batch-invariant), our kernels'
sources, torch's version (its library ops), the device type, the tensor-parallel degree and
whether a MoE model's experts are split whole over the ranks. Under
``--deterministic`` two responses to the same request with the same fingerprint are the same tokens and logprobs
(docs/determinism.md); without it, the same fingerprint only says the backend did not change.
"""

from __future__ import annotations

import hashlib

import torch

from kvmesh.engine.compile_cache import kernels_id


def system_fingerprint(
    model_fingerprint: bytes, device: torch.device, tensor_parallel_size: int = 1, expert_parallel: bool = False
) -> str:
    h = hashlib.sha256(model_fingerprint)
    # The ranks' partial sums round differently at each degree, and a MoE layer's differently with whole
    # experts per rank (the model fingerprint, part of every block hash, must not change with either:
    # blocks move between degrees).
    degree = [] if tensor_parallel_size == 1 else [f"tp{tensor_parallel_size}"] + (["ep"] if expert_parallel else [])
    for part in (kernels_id(), torch.__version__, device.type, *degree):
        h.update(b"\0" + part.encode())
    return "fp_" + h.hexdigest()[:12]
