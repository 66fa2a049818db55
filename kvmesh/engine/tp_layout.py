"""Which slice of a model one tensor-parallel rank holds (Megatron-style), as pure arithmetic.

Attention is split by heads: rank r of N holds query heads [r*H/N, (r+1)*H/N) and the KV heads they
read. With at least N KV heads each rank holds Hk/N of them; with fewer (GQA: SmolLM2 has 3 KV heads
for 9 query heads) the KV heads are replicated, rank r holding head r*Hk/N, which is the one its query
heads read, so N must be a multiple of Hk. The MLP is split by intermediate columns. q/k/v and gate/up
are column-parallel (each rank computes its heads' and its columns' outputs), o_proj and down_proj
row-parallel (each rank's partial sum, added up by one all-reduce after each). The embedding and the LM
head are vocab-parallel: rank r holds vocabulary rows [r*ceil(V/N), ...) of both, looks up the tokens that
fall in them (zeros for the rest) and computes their logits, and an all-reduce adds the ranks' parts up.
Norms stay whole on every rank. A config that cannot be split so is refused, saying why.

Multi-head Latent Attention splits by heads too (q_proj or q_b_proj and kv_b_proj by output rows, o_proj
by input columns, each head's own widths); what every head reads stays whole on every rank: the query's
bottleneck (q_a_proj), the latent's projection (kv_a_proj_with_mqa) and the latent pool (one "KV head").

A Mixture-of-Experts layer's routed experts are split one of two ways: by each expert's columns, as a
dense MLP is (every rank holds every expert, 1/N of each), or with ``expert_parallel`` whole, rank r
holding experts [r*E/N, (r+1)*E/N). Either way each rank's output is a partial sum the MLP's all-reduce
completes (a token's pairs with another rank's experts count 0 here), the router and DeepSeek's
correction bias stay whole (every rank routes every token alike), and shared experts split by columns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvmesh.checkpoint.mla_config import MLAConfig
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.checkpoint.moe_config import MoEConfig
from kvmesh.errors import InvalidArgument

# HF weight-name suffix -> how it is split: "rows-q"/"rows-kv"/"rows-mlp" slice output rows (column
# parallel), "cols-q"/"cols-mlp" slice input columns (row parallel), "rows-vocab" the vocabulary rows of
# the embedding and an untied LM head. Anything else is whole.
_SPLITS = {
    "self_attn.q_proj.weight": "rows-q",
    "self_attn.q_proj.bias": "rows-q",
    "self_attn.k_proj.weight": "rows-kv",
    "self_attn.k_proj.bias": "rows-kv",
    "self_attn.v_proj.weight": "rows-kv",
    "self_attn.v_proj.bias": "rows-kv",
    "mlp.gate_proj.weight": "rows-mlp",
    "mlp.up_proj.weight": "rows-mlp",
    "self_attn.o_proj.weight": "cols-q",
    "mlp.down_proj.weight": "cols-mlp",
    "model.embed_tokens.weight": "rows-vocab",
    "lm_head.weight": "rows-vocab",
}


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # A Mixture-of-Experts model's experts: each whole on one rank (True) or split by columns.
    expert_parallel: bool = False
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> TPLayout:
        """Rank ``rank`` of ``size`` over ``cfg``; InvalidArgument naming the config where it cannot be split."""
        if size < 1 or not 0 <= rank < size:
            raise InvalidArgument(f"tensor-parallel rank {rank} of {size}: no such rank")
        why = []
        if cfg.num_heads % size:
            why.append(f"{cfg.num_heads} attention heads")
        if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
            why.append(f"{cfg.num_kv_heads} KV heads (neither divisible by {size} nor dividing it)")
        if cfg.intermediate_size % size:
            why.append(f"intermediate size {cfg.intermediate_size}")
        moe = cfg.moe
        if moe is not None and expert_parallel and moe.num_experts % size:
            why.append(f"{moe.num_experts} experts")
        if moe is not None and not expert_parallel and moe.expert_intermediate_size % size:
            why.append(f"expert intermediate size {moe.expert_intermediate_size} (or --enable-expert-parallel)")
        if moe is not None and moe.shared_intermediate_size % size:
            why.append(f"shared experts' intermediate size {moe.shared_intermediate_size}")
        if why:
            raise InvalidArgument(
                f"tensor parallelism of {size} cannot split {cfg.architecture}: {', '.join(why)} "
                f"do not divide by {size}"
            )
        return cls(
            rank,
            size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            expert_parallel,
            moe,
            cfg.mla,
        )

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_replicated(self) -> bool:
        """More ranks than KV heads: several ranks hold the same KV head."""
        return self.size > self.num_kv_heads

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` as this rank's layers see it: its heads, its KV heads, its intermediate columns."""
        moe = self.moe
        if moe is not None:
            first, count = self.expert_range()
            moe = replace(
                moe,
                expert_intermediate_size=moe.expert_intermediate_size // (1 if self.expert_parallel else self.size),
                shared_intermediate_size=moe.shared_intermediate_size // self.size,
                expert_slice=(first, count),
            )
        return replace(
            cfg,
            num_heads=self.local_heads,
            num_kv_heads=self.local_kv_heads,
            intermediate_size=self.intermediate_size // self.size,
            moe=moe,
        )

    def expert_range(self) -> tuple[int, int]:
        """(first, count) of the routed experts this rank holds (all of them unless ``expert_parallel``)."""
        experts = self.moe.num_experts
        if not self.expert_parallel:
            return 0, experts
        per = experts // self.size
        return self.rank * per, per

    def shard_expert(self, part: str, tensor: torch.Tensor, shared: bool = False) -> torch.Tensor:
        """This rank's part of one expert's ``part`` ("gate", "up": [I, H]; "down": [H, I]) projection: whole
        under expert parallelism, else its 1/N of the columns of I (a shared expert's always so)."""
        if self.size == 1 or (self.expert_parallel and not shared):
            return tensor
        axis = 1 if part == "down" else 0
        per = tensor.shape[axis] // self.size
        return tensor.narrow(axis, self.rank * per, per)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """(first, count) of the vocabulary rows of the embedding and LM head this rank holds: ceil(V/N) a
        rank, the last rank's fewer where N does not divide V."""
        per = -(-vocab_size // self.size)
        first = min(vocab_size, self.rank * per)
        return first, min(vocab_size, first + per) - first

    def kv_head_range(self) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds."""
        if self.kv_replicated:  # the one KV head this rank's query heads read
            return self.rank * self.num_kv_heads // self.size, 1
        return self.rank * self.local_kv_heads, self.local_kv_heads

    def _range(self, kind: str) -> tuple[int, int]:
        """(first, count) of the rows or columns ``kind`` names that this rank holds."""
        d = self.head_dim
        if kind == "q":
            return self.rank * self.local_heads * d, self.local_heads * d
        if kind == "kv":
            first, count = self.kv_head_range()
            return first * d, count * d
        if kind != "mlp":
            raise ValueError(f"no {kind!r} split in a layer (the vocabulary's rows: vocab_range)")
        per = self.intermediate_size // self.size
        return self.rank * per, per

    def lora_factors(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA delta ``b @ a`` (b [out, r], a [r, in]) on the HF projection ``module``
        (``q_proj`` ...): where its output rows are split, b's rows; where its input columns are, a's."""
        how = next((v for k, v in _SPLITS.items() if k.endswith(f".{module}.weight")), None)
        if how is None or self.size == 1:
            return a, b
        axis, kind = how.split("-")
        first, count = self._range(kind)
        return (a, b.narrow(0, first, count)) if axis == "rows" else (a.narrow(1, first, count), b)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the HF-named checkpoint tensor ``name`` (whole where it is not split)."""
        if self.mla is not None and ".self_attn." in name:
            return self._shard_mla(name, tensor)
        how = next((v for k, v in _SPLITS.items() if name.endswith(k)), None)
        if how is None or self.size == 1:
            return tensor
        axis, kind = how.split("-")
        first, count = self.vocab_range(tensor.shape[0]) if kind == "vocab" else self._range(kind)
        return tensor.narrow(0 if axis == "rows" else 1, first, count)

    def _shard_mla(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's heads of an MLA projection: rows of q_proj / q_b_proj (qk_head_dim a head) and kv_b_proj
        (nope + v a head), columns of o_proj (v a head); the rest whole."""
        mla, per_rank = self.mla, self.local_heads
        widths = {
            "self_attn.q_proj.weight": (0, mla.qk_head_dim),
            "self_attn.q_b_proj.weight": (0, mla.qk_head_dim),
            "self_attn.kv_b_proj.weight": (0, mla.qk_nope_head_dim + mla.v_head_dim),
            "self_attn.o_proj.weight": (1, mla.v_head_dim),
        }
        how = next((v for k, v in widths.items() if name.endswith(k)), None)
        if how is None or self.size == 1:
            return tensor
        axis, width = how
        return tensor.narrow(axis, self.rank * per_rank * width, per_rank * width)
