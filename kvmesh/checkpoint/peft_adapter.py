"""A LoRA adapter in PEFT's format, read and checked against the base model it adapts.

A PEFT folder holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, per-module ``rank_pattern``/``alpha_pattern``) and ``adapter_model.safetensors``
with, per adapted projection, ``...layers.<i>.<module>.lora_A.weight`` [r, in] and ``lora_B.weight``
[out, r]. The adapter adds ``scale * B @ A @ x`` to that projection's output, ``scale`` being
``alpha / r`` (``alpha / sqrt(r)`` with rslora).

Everything that would make the engine compute something PEFT does not (DoRA, trained biases, extra
trained modules, a target the model lacks, a shape that does not fit) is refused here with an
``InvalidArgument`` naming it, before any weight reaches a worker's slots. Torch is needed for the
tensors; no engine import.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.errors import InvalidArgument

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target (Hugging Face names, as PEFT's target_modules gives them).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraTarget:
    """One adapted projection of one layer: its low-rank factors, the scale folded into ``b``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], already multiplied by the adapter's scale for this module

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    path: Path
    rank: int  # the largest rank of any module
    # (layer, HF module name) -> its factors
    targets: dict[tuple[int, str], LoraTarget]
    # blake2b of the config and the weights: the adapter's identity in the block hash chain
    # (kvmesh.blocks.adapter_fingerprint), equal for the same files wherever they are loaded.
    fingerprint: bytes


def projection_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in features, out features) of a base projection."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def load_peft_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> PeftAdapter:
    """Read and check the PEFT folder ``path`` for a model of ``cfg``; InvalidArgument names what is wrong."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise InvalidArgument(f"{path}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    if not (path / WEIGHTS_FILE).is_file():
        raise InvalidArgument(f"{path}: no {WEIGHTS_FILE}")
    raw = (path / CONFIG_FILE).read_bytes()
    try:
        conf = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{path / CONFIG_FILE}: not valid JSON ({e})") from None
    _check_config(path, conf)
    tensors, digest = _read_weights(path / WEIGHTS_FILE)
    digest.update(raw)
    targets = _pair_factors(path, tensors, conf, cfg)
    rank = max(t.rank for t in targets.values())
    if rank > max_rank:
        raise InvalidArgument(f"{path}: rank {rank} is above this worker's max LoRA rank {max_rank}")
    return PeftAdapter(path=path, rank=rank, targets=targets, fingerprint=digest.digest())


def _check_config(path: Path, conf: dict) -> None:
    kind = conf.get("peft_type", "LORA")
    if kind != "LORA":
        raise InvalidArgument(f"{path}: peft_type {kind!r} is not served (only LORA)")
    if conf.get("use_dora"):
        raise InvalidArgument(f"{path}: DoRA adapters are not served")
    if conf.get("bias", "none") != "none":
        raise InvalidArgument(f"{path}: trained biases (bias={conf['bias']!r}) are not served")
    if conf.get("modules_to_save"):
        raise InvalidArgument(f"{path}: modules_to_save {conf['modules_to_save']} are not served (LoRA factors only)")
    if conf.get("fan_in_fan_out"):
        raise InvalidArgument(f"{path}: fan_in_fan_out adapters are not served")
    if not isinstance(conf.get("r"), int) or conf["r"] <= 0:
        raise InvalidArgument(f"{path}: r must be a positive integer, got {conf.get('r')!r}")


def _read_weights(file: Path) -> tuple[dict[str, torch.Tensor], hashlib.blake2b]:
    digest = hashlib.blake2b(b"kvmesh-peft-v1", digest_size=16)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name)
                tensors[name] = t
                digest.update(name.encode())
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    except (SafetensorError, OSError, RuntimeError) as e:
        raise InvalidArgument(f"{file}: corrupt or unreadable safetensors file ({e})") from None
    return tensors, digest


def _scale(conf: dict, full: str, rank: int) -> float:
    """PEFT's scale for the module named ``full`` (``model.layers.<i>.<parent>.<module>``): an
    ``alpha_pattern`` key matching that name (as PEFT matches them: a suffix on a dot boundary, as a
    regex) overrides ``lora_alpha``."""
    pattern = conf.get("alpha_pattern") or {}
    key = next((k for k in pattern if re.match(rf"(.*\.)?{k}$", full)), None)
    alpha = pattern[key] if key is not None else conf.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank


def _pair_factors(
    path: Path, tensors: dict[str, torch.Tensor], conf: dict, cfg: ModelConfig
) -> dict[tuple[int, str], LoraTarget]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    parents: dict[str, str] = {}  # HF module -> self_attn or mlp, as the tensor names say
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None:
            experts = " (LoRA on experts is not served)" if ".experts." in name else ""
            raise InvalidArgument(
                f"{path}: tensor {name!r} is not a LoRA factor of a decoder layer's projection{experts}"
            )
        layer, parent, module, half = int(m[1]), m[2], m[3], m[4]
        parents[module] = parent
        if module not in TARGETS:
            raise InvalidArgument(f"{path}: target {module!r} is not a projection of {cfg.architecture}")
        if layer >= cfg.num_layers:
            raise InvalidArgument(f"{path}: layer {layer} does not exist (the model has {cfg.num_layers})")
        if parent == "mlp" and cfg.moe is not None and cfg.moe.sparse_layers[layer]:
            raise InvalidArgument(
                f"{path}: layers.{layer}.{module}: LoRA on a Mixture-of-Experts layer's experts is not served "
                f"(adapters of {cfg.architecture} may target the attention projections and dense layers' MLPs)"
            )
        halves.setdefault((layer, module), {})[half] = t
    if not halves:
        raise InvalidArgument(f"{path}: {WEIGHTS_FILE} holds no LoRA factors")
    targets = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"{path}: layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise InvalidArgument(f"{where}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        n_in, n_out = projection_shape(cfg, module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise InvalidArgument(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                f"[{n_out} x {n_in}] projection (expected [r, {n_in}] and [{n_out}, r])"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InvalidArgument(f"{where}: the factors hold NaN or infinite values")
        scale = _scale(conf, f"model.layers.{layer}.{parents[module]}.{module}", a.shape[0])
        targets[layer, module] = LoraTarget(a=a.float(), b=b.float() * scale)
    return targets
