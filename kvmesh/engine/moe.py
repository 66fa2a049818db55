"""Mixture-of-Experts models (Qwen3-MoE, Mixtral): the Llama decoder whose sparse layers' MLP is a
router and a set of experts (``SparseMoE``), with DeepSeek-V3's routing, shared experts and dense
first layers as options of the same module (``kvmesh.checkpoint.moe_config``).

The experts run as one op behind the kernel dispatcher (``kernels.reference.moe_experts``: grouped
by expert on CPU, the fused Triton kernel on GPUs), so nothing here loops over tokens or experts.
Attention is the Llama layer's; the KV cache, and so the P/D hand-off, are those of a dense model.
Over tensor-parallel ranks each holds its share of the experts (``kvmesh.engine.tp_layout``: whole
experts under expert parallelism, else every expert's columns) and the layer's all-reduce sums them.

Weights load from both layouts checkpoints come in: one tensor per expert and projection (what
real checkpoints and transformers' ``save_pretrained`` write: ``experts.{e}.gate_proj``, Mixtral's
``experts.{e}.w1``/``w3``/``w2``) and transformers' fused 3D tensors (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I]).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from kernels import Ops
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.checkpoint.moe_config import MoEConfig
from kvmesh.engine.model import GATED_ACTIVATIONS, CausalLM, DecoderLayer
from kvmesh.engine.moe_routing import route
from kvmesh.engine.tp_layout import TPLayout
from kvmesh.errors import FailedPrecondition, ModelLoadError

Checkpoint = Callable[..., Iterable[tuple[str, torch.Tensor]]]

# The config's activation -> the name ``kernels.reference.moe_experts`` knows it by.
_EXPERT_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# A sparse layer's tensors: Qwen3-MoE and DeepSeek under ``mlp.``, Mixtral under ``block_sparse_moe.``.
_SPARSE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
# Each projection's part of an expert: Mixtral's w1 is the gate, w3 the up, w2 the down projection.
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class SparseMoE(nn.Module):
    """A router, the routed experts (all of them, stacked) and the shared experts if the config has any."""

    def __init__(self, moe: MoEConfig, hidden_size: int, hidden_act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = moe
        e, i = moe.num_experts, moe.expert_intermediate_size
        self.first_expert, local = moe.local_experts
        # DeepSeek-V3 scores in float32 (its bias-corrected choice is sensitive to rounding); the
        # softmax routers take the model's dtype, as transformers does, and softmax in float32.
        router_dtype = torch.float32 if moe.scoring == "sigmoid" else dtype
        self.router = nn.Linear(hidden_size, e, bias=False, dtype=router_dtype)
        self.correction_bias = nn.Parameter(torch.zeros(e)) if moe.has_correction_bias else None
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * i, hidden_size, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(local, hidden_size, i, dtype=dtype))
        self.act = GATED_ACTIVATIONS[hidden_act]
        self.expert_act = _EXPERT_ACTIVATIONS[hidden_act]
        s = moe.shared_intermediate_size
        self.shared_gate_up = nn.Linear(hidden_size, 2 * s, bias=False, dtype=dtype) if s else None
        self.shared_down = nn.Linear(s, hidden_size, bias=False, dtype=dtype) if s else None
        # Tokens routed to each expert, counted by every forward (warm-ups too); read by ``expert_tokens``.
        self.register_buffer("expert_tokens", torch.zeros(e, dtype=torch.int64), persistent=False)

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x.to(self.router.weight.dtype))
        weights, ids = route(logits, self.cfg, self.correction_bias)
        chosen = ids.flatten()  # an index_add, not a bincount: its shape is static, so compiled graphs keep it
        self.expert_tokens.index_add_(0, chosen, torch.ones_like(chosen))
        if self.w_gate_up.shape[0] < self.cfg.num_experts:  # expert parallelism: the others' pairs are -1 here
            local = ids - self.first_expert
            ids = local.masked_fill((local < 0) | (local >= self.w_gate_up.shape[0]), -1)
        out = ops.moe_experts(x, ids, weights, self.w_gate_up, self.w_down, self.expert_act)
        if self.shared_gate_up is not None:
            out = out + self.shared_down(getattr(ops, self.act)(self.shared_gate_up(x)))
        return out


class MoEDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__(cfg, dtype, index)
        sparse = not self.has_dense_mlp(cfg, index)
        self.moe = SparseMoE(cfg.moe, cfg.hidden_size, cfg.hidden_act, dtype) if sparse else None

    def has_dense_mlp(self, cfg: ModelConfig, index: int) -> bool:
        return not cfg.moe.sparse_layers[index]

    def mlp(self, ops: Ops, hidden: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return super().mlp(ops, hidden)
        hidden = self.moe(ops, hidden)
        if self.all_reduce is not None:  # each rank's experts' (and shared experts' columns') part
            self.all_reduce(hidden)
        return hidden


class MoECausalLM(CausalLM):
    LAYER = MoEDecoderLayer

    def sparse_layers(self) -> list[SparseMoE]:
        return [layer.moe for layer in self.layers if layer.moe is not None]

    def quantize(self, scheme: str, head: bool = False) -> None:
        raise FailedPrecondition(
            f"{self.cfg.architecture}: 8-bit weights for Mixture-of-Experts experts are not built; serve it unquantized"
        )

    def load_weights(self, checkpoint: Checkpoint) -> None:
        loaded: set[str] = set()
        super().load_weights(self._experts_taken(checkpoint, loaded))
        missing = self._expected_expert_parts() - loaded
        if missing:
            raise ModelLoadError(f"checkpoint is missing expert weights: {', '.join(sorted(missing)[:5])}")

    def _experts_taken(self, checkpoint: Checkpoint, loaded: set[str]) -> Checkpoint:
        """``checkpoint`` without the sparse layers' tensors, which are copied into their ``SparseMoE``
        on the way (their parts recorded in ``loaded``)."""

        def rest(names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in checkpoint() if names is None else checkpoint(names):
                match = _SPARSE.fullmatch(name)
                moe = self.layers[int(match.group(1))].moe if match else None
                if moe is None:
                    yield name, tensor
                    continue
                for part in _copy_into(moe, match.group(2), tensor, name, self.tp):
                    loaded.add(f"model.layers.{match.group(1)}.{part}")

        return rest

    def _expected_expert_parts(self) -> set[str]:
        parts = set()
        for layer in self.layers:
            if layer.moe is None:
                continue
            p = f"model.layers.{layer.index}."
            first, count = layer.moe.cfg.local_experts
            names = ["router"] + [f"expert.{e}.{x}" for e in range(first, first + count) for x in _PARTS]
            names += ["correction_bias"] if layer.moe.correction_bias is not None else []
            names += [f"shared.{x}" for x in _PARTS] if layer.moe.shared_gate_up is not None else []
            parts |= {p + n for n in names}
        return parts

    def _expected_names(self, fused: dict, renamed: dict) -> set[str]:
        """The dense layers' names (a sparse layer's MLP is checked by ``_expected_expert_parts``)."""
        names = super()._expected_names(fused, renamed)
        sparse = {f"model.layers.{layer.index}.mlp." for layer in self.layers if layer.moe is not None}
        return {n for n in names if not any(n.startswith(prefix) for prefix in sparse)}


_PARTS = ("gate", "up", "down")


def expert_tokens(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert of each sparse layer of ``model`` so far: layer index -> a count
    per expert ({} for a dense model). Read from another thread, a count may be a step old."""
    layers = getattr(model, "layers", ())
    return {layer.index: layer.moe.expert_tokens.tolist() for layer in layers if getattr(layer, "moe", None)}


def _copy_into(moe: SparseMoE, rest: str, tensor: torch.Tensor, name: str, tp: TPLayout | None = None) -> list[str]:
    """Copy this rank's part (``tp``: None for the whole model) of the sparse-layer tensor ``name``
    (``rest`` after its layer's MLP prefix) into ``moe``; the parts it filled (none for another rank's
    expert)."""
    i = moe.cfg.expert_intermediate_size
    s = moe.cfg.shared_intermediate_size
    first, count = moe.cfg.local_experts
    shard = tp.shard_expert if tp is not None else lambda part, t, shared=False: t
    if rest == "gate.weight":
        return _put(moe.router.weight.data, tensor, name, ["router"])
    if rest == "gate.e_score_correction_bias" and moe.correction_bias is not None:
        return _put(moe.correction_bias.data, tensor, name, ["correction_bias"])
    experts = range(first, first + count)
    if rest == "experts.gate_up_proj":  # [E, gate rows then up rows, H]
        held = [torch.cat([shard(x, w) for x, w in zip(("gate", "up"), tensor[e].chunk(2))]) for e in experts]
        return _put(
            moe.w_gate_up.data, torch.stack(held), name, [f"expert.{e}.{x}" for e in experts for x in _PARTS[:2]]
        )
    if rest == "experts.down_proj":  # [E, H, I]
        held = [shard("down", tensor[e]) for e in experts]
        return _put(moe.w_down.data, torch.stack(held), name, [f"expert.{e}.down" for e in experts])
    per_expert = _PER_EXPERT.fullmatch(rest)
    if per_expert:
        e, part = int(per_expert.group(1)), _PART[per_expert.group(2)]
        if e >= moe.cfg.num_experts:
            raise ModelLoadError(f"weight {name!r}: expert {e} of {moe.cfg.num_experts}")
        if not first <= e < first + count:
            return []  # another rank's
        here = e - first
        dst = moe.w_down.data[here] if part == "down" else moe.w_gate_up.data[here, (part == "up") * i :][:i]
        return _put(dst, shard(part, tensor), name, [f"expert.{e}.{part}"])
    if rest.startswith("shared_experts.") and moe.shared_gate_up is not None:
        part = _PART.get(rest.removeprefix("shared_experts.").removesuffix(".weight"))
        if part == "down":
            return _put(moe.shared_down.weight.data, shard(part, tensor, shared=True), name, ["shared.down"])
        if part is not None:
            dst = moe.shared_gate_up.weight.data[(part == "up") * s :][:s]
            return _put(dst, shard(part, tensor, shared=True), name, [f"shared.{part}"])
    raise ModelLoadError(f"weight {name!r} has no place in a Mixture-of-Experts layer")


def _put(dst: torch.Tensor, tensor: torch.Tensor, name: str, parts: list[str]) -> list[str]:
    if dst.shape != tensor.shape:
        raise ModelLoadError(f"weight {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor.to(dst.dtype))
    return parts
