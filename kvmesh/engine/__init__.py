"""The shared engine that prefill and decode both run: model, paged KV, scheduler, sampler."""

from kvmesh.engine.config import EngineConfig, ModelConfig
from kvmesh.engine.engine import Completion, EngineStats, LLMEngine, RequestOutput
from kvmesh.engine.kv_cache import BlockPayload
from kvmesh.engine.sampling_params import SamplingParams

__all__ = [
    "BlockPayload",
    "Completion",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
