"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2), read from its ``config.json``: ``MLAConfig``.

MLA caches one compressed latent per token and layer instead of per-head keys and values: the
``kv_lora_rank``-wide output of ``kv_a_proj_with_mqa`` (normed) and the ``qk_rope_head_dim``-wide key
part that carries the rotary position, shared by every head. Heads get their keys and values back
through ``kv_b_proj``; kvmesh folds it into the query and the output instead (``kvmesh.engine.mla``),
so attention runs over the latent itself. Torch-free: the gateway reads configs too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import ModelLoadError


@dataclass(frozen=True)
class MLAConfig:
    # The query's own low-rank bottleneck (q_a_proj -> norm -> q_b_proj); None: one q_proj.
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # DeepSeek's checkpoints lay the rotary dimensions out in interleaved pairs (transformers' default).
    rope_interleave: bool

    @property
    def latent_width(self) -> int:
        """What the pool holds per token and layer: the latent, then the rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_config(raw: dict[str, Any], source: str) -> MLAConfig:
    try:
        q_lora = raw.get("q_lora_rank")
        cfg = MLAConfig(
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            rope_interleave=bool(raw.get("rope_interleave", True)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing field {e.args[0]!r} (Multi-head Latent Attention)") from None
    if cfg.qk_rope_head_dim % 2:
        raise ModelLoadError(f"{source}: qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (rotary pairs)")
    return cfg


def mla_softmax_scale(cfg: MLAConfig, rope: dict[str, Any]) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale squared where the rope scaling sets ``mscale_all_dim``
    (DeepSeek-V3 and Kimi K2 do), as transformers' ``yarn_apply_mscale``."""
    scale = cfg.qk_head_dim**-0.5
    all_dim = rope.get("mscale_all_dim") or 0
    factor = float(rope.get("factor") or 1.0)
    if rope.get("rope_type", "default") != "default" and all_dim:
        scale *= yarn_mscale(factor, all_dim) ** 2
    return scale


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context ``factor`` times the trained one (1 at no extension)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
