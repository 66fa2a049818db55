"""Rotary position embedding frequencies, including the common scaling types.

Supported ``rope_type``: ``default``, ``linear``, ``llama3``, ``yarn``.
``dynamic`` (dynamic NTK) is refused: it changes the rotary frequencies with the
running sequence length, so KV cached at one length would not match the same
prefix at another — incompatible with prefix caching and KV transfer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvmesh.checkpoint.mla_config import yarn_mscale
from kvmesh.checkpoint.model_config import ROPE_TYPES
from kvmesh.errors import ModelLoadError


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p["factor"]
    orig = p.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    attn_factor = p.get("attention_factor")
    if attn_factor is None:  # DeepSeek's configs give mscale and mscale_all_dim: their ratio, as transformers
        mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim else None
    if attn_factor is None:
        attn_factor = yarn_mscale(factor, 1.0)

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate, interpolate = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolate * (1 - extrapolation_weight) + extrapolate * extrapolation_weight
    return inv_freq, float(attn_factor)


def rope_cos_sin_cache(rope: dict[str, Any], head_dim: int, max_positions: int, max_pos_cfg: int) -> torch.Tensor:
    """A float32 table [max_positions, head_dim]: cos in the first half, sin in the second."""
    rope_type = rope.get("rope_type", "default")
    theta = float(rope.get("rope_theta", 10000.0))
    dim = head_dim  # a partial_rotary_factor is refused when the config is read (ModelConfig)
    scale = 1.0
    if rope_type == "default":
        inv_freq = _base_inv_freq(theta, dim)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(theta, dim) / float(rope["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(_base_inv_freq(theta, dim), rope)
    elif rope_type == "yarn":
        inv_freq, scale = _yarn(theta, dim, rope, max_pos_cfg)
    else:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
