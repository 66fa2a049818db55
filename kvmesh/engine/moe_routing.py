"""Which experts each token goes to, and with what weights: the routers of the MoE families served.

Both are row-wise (a token's choice depends on its own router logits only), so routing is
batch-invariant whenever the router's product is (deterministic serving runs it as an invariant
linear). Scores are computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

from kvmesh.checkpoint.moe_config import MoEConfig


def route(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) from the router's logits [T, E]."""
    if cfg.scoring == "softmax":
        return _softmax_top_k(logits.float(), cfg)
    return _grouped_sigmoid_top_k(logits.float(), cfg, correction_bias)


def _softmax_top_k(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE and Mixtral: the k most probable experts, their probabilities renormalised to sum
    to 1 where ``norm_topk_prob`` says so (always for Mixtral)."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _grouped_sigmoid_top_k(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ("noaux_tc"): each expert's sigmoid score; the choice is made on score plus the
    expert's correction bias (which balances load without an auxiliary loss), among the experts of
    the ``topk_group`` groups whose two best biased scores sum highest; the weights are the chosen
    experts' unbiased scores, renormalised, times ``routed_scaling_factor``."""
    scores = torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.n_group > 1:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(t, -1)
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids
