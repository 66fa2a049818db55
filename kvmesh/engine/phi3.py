"""Phi-3: Llama's maths, with q/k/v and gate/up fused in the checkpoint (``qkv_proj``, ``gate_up_proj``).

The fused tensors are split into the names a Llama checkpoint uses as they are read, so everything that
goes by those names (tensor-parallel slicing, quantization plans, the load's completeness check) works
unchanged; the layers fuse them again as for any family. Every layer slides when ``sliding_window`` is
set (``ModelConfig.layer_windows``); ``longrope`` (the 128k variants) is refused by name when the
config is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from kvmesh.engine.model import CausalLM

Checkpoint = Callable[..., Iterable[tuple[str, torch.Tensor]]]


class Phi3CausalLM(CausalLM):
    def load_weights(self, checkpoint: Checkpoint) -> None:
        super().load_weights(self._split(checkpoint))

    def _split(self, checkpoint: Checkpoint) -> Checkpoint:
        cfg = self.cfg
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

        def split(names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in checkpoint() if names is None else checkpoint(names):
                if name.endswith(".self_attn.qkv_proj.weight"):
                    stem = name.removesuffix("qkv_proj.weight")
                    yield from zip((stem + f"{x}_proj.weight" for x in "qkv"), tensor.split([q, kv, kv]))
                elif name.endswith(".mlp.gate_up_proj.weight"):
                    stem = name.removesuffix("gate_up_proj.weight")
                    yield from zip((stem + "gate_proj.weight", stem + "up_proj.weight"), tensor.split([inter, inter]))
                else:
                    yield name, tensor

        return split
