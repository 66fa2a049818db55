"""Which model class serves an architecture: the Llama decoder (``kvmesh.engine.model``) unless a family
has a module of its own. A new family is a module here, behind the same interface, not a branch in
every layer."""

from __future__ import annotations

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.gemma import Gemma3CausalLM
from kvmesh.engine.mla import DeepseekV3CausalLM
from kvmesh.engine.model import CausalLM
from kvmesh.engine.moe import MoECausalLM
from kvmesh.engine.phi3 import Phi3CausalLM

_FAMILY_MODELS: dict[str, type[CausalLM]] = {
    "Gemma3ForCausalLM": Gemma3CausalLM,
    "Phi3ForCausalLM": Phi3CausalLM,
    "Qwen3MoeForCausalLM": MoECausalLM,
    "MixtralForCausalLM": MoECausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3CausalLM,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return _FAMILY_MODELS.get(cfg.architecture, CausalLM)
