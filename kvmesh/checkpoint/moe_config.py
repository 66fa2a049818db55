"""A Mixture-of-Experts family's routing, read from its ``config.json``: ``MoEConfig``.

Three dialects say the same things differently: Qwen3-MoE (``num_experts``, ``norm_topk_prob``,
``decoder_sparse_step`` / ``mlp_only_layers``), Mixtral (``num_local_experts``, the experts as wide as
``intermediate_size``, weights always renormalised) and DeepSeek-V3 (sigmoid scores with a per-expert
correction bias, group-limited top-k over ``n_group`` groups, ``routed_scaling_factor``, shared experts,
the first ``first_k_dense_replace`` layers dense). Each is read here into one description the engine's
MoE layer (``kvmesh.engine.moe``) computes from. Torch-free: the gateway reads configs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.errors import ModelLoadError

# The families (kvmesh.checkpoint.model_config.SUPPORTED_ARCHITECTURES' values) whose routing is read here.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    # Each routed expert's MLP width.
    expert_intermediate_size: int
    # "softmax": probabilities over every expert, then the top k (Qwen3-MoE, Mixtral); "sigmoid": each
    # expert's own score, chosen with a correction bias added, weighed without it (DeepSeek-V3).
    scoring: str
    # Whether the k chosen weights are divided by their sum.
    norm_topk_prob: bool
    # Group-limited routing: the experts split into ``n_group`` groups, a token picks among the experts
    # of its ``topk_group`` best groups only (a group scores by its two best experts). 1, 1: no limit.
    n_group: int
    topk_group: int
    # The chosen weights' factor (DeepSeek-V3: 2.5).
    routed_scaling_factor: float
    # The width of the shared experts every token also goes through (their outputs are added
    # unweighted); 0: none.
    shared_intermediate_size: int
    # Per layer: whether its MLP is the experts (True) or a dense MLP as wide as ``intermediate_size``.
    sparse_layers: tuple[bool, ...]
    # (first, count) of the routed experts one tensor-parallel rank holds (kvmesh.engine.tp_layout); None:
    # the checkpoint's description, every expert.
    expert_slice: tuple[int, int] | None = None

    @property
    def local_experts(self) -> tuple[int, int]:
        """(first, count) of the experts held here."""
        return self.expert_slice or (0, self.num_experts)

    @property
    def has_correction_bias(self) -> bool:
        """DeepSeek-V3's ``e_score_correction_bias``: added to the scores that choose, not to the weights."""
        return self.scoring == "sigmoid"


def moe_config(raw: dict[str, Any], family: str, num_layers: int, source: str) -> MoEConfig | None:
    """The routing of a family in ``MOE_FAMILIES`` (None for a dense one); ModelLoadError naming a field
    whose value we would compute differently from transformers."""
    if family not in MOE_FAMILIES:
        return None
    top_k = int(raw["num_experts_per_tok"])
    if family == "mixtral":
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        cfg = MoEConfig(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=int(raw["intermediate_size"]),
            scoring="softmax",
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            shared_intermediate_size=0,
            sparse_layers=(True,) * num_layers,
        )
    elif family == "qwen3_moe":
        # Real checkpoints write num_experts; transformers 5 saves it as num_local_experts.
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or ())
        cfg = MoEConfig(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=int(raw["moe_intermediate_size"]),
            scoring="softmax",
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            shared_intermediate_size=0,
            sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
        )
    else:
        cfg = _deepseek_v3(raw, top_k, num_layers, source)
    _check(cfg, source)
    return cfg


def _deepseek_v3(raw: dict[str, Any], top_k: int, num_layers: int, source: str) -> MoEConfig:
    # DeepSeek's own configs name the routing they were trained with; transformers implements these only.
    for name, served in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(name, served) != served:
            raise ModelLoadError(f"{source}: {name}={raw[name]!r} is not served (DeepSeek-V3 routing is {served!r})")
    first_dense = int(raw.get("first_k_dense_replace", 0))
    every = int(raw.get("moe_layer_freq", 1))
    experts = int(raw.get("n_routed_experts") or 0)
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        scoring="sigmoid",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=int(raw.get("n_shared_experts") or 0) * int(raw["moe_intermediate_size"]),
        sparse_layers=tuple(experts > 0 and i >= first_dense and i % every == 0 for i in range(num_layers)),
    )


def _check(cfg: MoEConfig, source: str) -> None:
    if cfg.num_experts < 1:
        raise ModelLoadError(f"{source}: a Mixture-of-Experts config with {cfg.num_experts} experts")
    if not 1 <= cfg.top_k <= cfg.num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok={cfg.top_k} with {cfg.num_experts} experts")
    if cfg.num_experts % cfg.n_group or not 1 <= cfg.topk_group <= cfg.n_group:
        raise ModelLoadError(
            f"{source}: n_group={cfg.n_group}, topk_group={cfg.topk_group} with {cfg.num_experts} experts "
            "(the groups must divide the experts, and a token picks from 1 to n_group of them)"
        )
    if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
        raise ModelLoadError(f"{source}: n_group={cfg.n_group} leaves fewer than 2 experts a group to score it by")
    if cfg.n_group > 1 and cfg.top_k > cfg.topk_group * (cfg.num_experts // cfg.n_group):
        raise ModelLoadError(
            f"{source}: num_experts_per_tok={cfg.top_k} exceeds the experts of topk_group={cfg.topk_group} groups"
        )
