"""Quantized checkpoints in the compressed-tensors layout vLLM reads, and loading them back.

A *plan* maps Hugging Face module names (``model.layers.3.mlp.down_proj``) to format names.
The writer stores each planned module's weight as its format's tensors (``weight`` +
``weight_scale`` for fp8/int8; ``weight_packed`` + ``weight_scale`` + ``weight_global_scale``
for nvfp4) and says so in ``config.json``'s ``quantization_config``: one config group per
format whose ``targets`` name the modules. A tied model's LM head is its embedding: a plan
that names ``lm_head`` quantizes ``model.embed_tokens`` (vLLM quantizes only Linear layers;
kvmesh reads it, which is what the deliberately broken test plan needs).

Loading dequantizes on the fly into ordinary HF-named tensors (``dequantized_tensors``), so the
engine's loader, its q/k/v and gate/up fusion, and transformers all see plain weights.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvmesh.checkpoint.files import iter_tensors, weight_files
from kvmesh.checkpoint.formats import FORMATS, get_format
from kvmesh.errors import ModelLoadError

Plan = dict[str, str]
CT_METHOD = "compressed-tensors"
# Files of the source folder the quantized one needs too (tokenizer, chat template, provenance).
_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
           "provenance.json")  # fmt: skip


def linear_modules(names: list[str]) -> list[str]:
    """The quantizable projections of a checkpoint, from its tensor names, in order."""
    return [n[: -len(".weight")] for n in names if re.fullmatch(r"model\.layers\.\d+\.\w+\.\w+_proj\.weight", n)]


def head_tensor(config: dict[str, Any]) -> str:
    """Where the LM head's weight lives: the embedding when tied."""
    return "model.embed_tokens" if config.get("tie_word_embeddings") else "lm_head"


def quantization_config(plan: Plan, ignore: list[str]) -> dict[str, Any]:
    by_format: dict[str, list[str]] = {}
    for module, fmt in plan.items():
        by_format.setdefault(fmt, []).append(module)
    groups = {}
    for i, (fmt, targets) in enumerate(sorted(by_format.items())):
        f = get_format(fmt)
        groups[f"group_{i}"] = {
            "targets": targets,
            "weights": f.ct_weights,
            "input_activations": None,
            "output_activations": None,
            "format": f.ct_format,
        }
    formats = {get_format(f).ct_format for f in by_format}
    return {
        "quant_method": CT_METHOD,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
    }


def write_checkpoint(src: Path, out: Path, plan: Plan) -> Path:
    """Write ``src`` with ``plan`` applied to ``out`` (a folder the engine and vLLM can load)."""
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ModelLoadError(f"{src}: already quantized; quantize the unquantized model")
    tensors = dict(iter_tensors(weight_files(src)))
    head = head_tensor(config)
    stored = dict(tensors)
    for module, fmt in plan.items():
        key = head if module == "lm_head" else module
        if f"{key}.weight" not in stored:
            raise ModelLoadError(f"plan names {module!r}, which {src} does not have")
        weight = stored.pop(f"{key}.weight")
        for suffix, q in get_format(fmt).quantize(weight).items():
            stored[f"{key}.{suffix}"] = q.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    targets = {head if m == "lm_head" else m: f for m, f in plan.items()}
    ignore = [m for m in [*linear_modules(list(tensors)), "lm_head"] if m not in plan]
    config["quantization_config"] = quantization_config(targets, ignore)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def _format_of(group: dict[str, Any], source: str) -> str:
    w = group.get("weights") or {}
    for f in FORMATS.values():
        if group.get("format") == f.ct_format and all(w.get(k) == v for k, v in f.ct_weights.items()):
            return f.name
    raise ModelLoadError(f"{source}: unsupported compressed-tensors group {group.get('format')!r} {w}")


def read_plan(config: dict[str, Any], names: list[str], source: str = "config.json") -> Plan | None:
    """The checkpoint's module -> format map from its quantization_config; None when unquantized."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != CT_METHOD:
        raise ModelLoadError(f"{source}: quant_method {qc.get('quant_method')!r} unsupported; kvmesh reads {CT_METHOD}")
    modules = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(("weight_scale", "weight_packed"))})
    plan: Plan = {}
    for group in qc.get("config_groups", {}).values():
        fmt = _format_of(group, source)
        for target in group.get("targets", []):
            if target.startswith("re:"):
                matched = [m for m in modules if re.fullmatch(target[3:], m)]
            elif target == "Linear":
                matched = modules
            else:
                matched = [target] if target in modules else []
            plan.update({m: fmt for m in matched if m not in qc.get("ignore", [])})
    missing = [m for m in modules if m not in plan]
    if missing:
        raise ModelLoadError(f"{source}: quantized tensors without a config group: {', '.join(missing[:3])}")
    return plan


def dequantized_tensors(
    config: dict[str, Any], files: list[Path], names: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 weights of a compressed-tensors checkpoint; with ``names``, only those (no other
    module is dequantized)."""
    tensors = dict(iter_tensors(files))
    plan = read_plan(config, list(tensors), str(files[0].parent / "config.json"))
    assert plan is not None

    def wanted(name: str) -> bool:
        return names is None or name in names

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for module, fmt in plan.items():
            parts = {k[len(module) + 1 :]: tensors.pop(k) for k in list(tensors) if k.startswith(module + ".weight")}
            if wanted(f"{module}.weight"):
                yield f"{module}.weight", get_format(fmt).dequantize(parts)
        yield from ((n, t) for n, t in tensors.items() if wanted(n))

    return gen()


def checkpoint_tensors(
    config: dict[str, Any], files: list[Path], names: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named weights of a checkpoint's ``files``, dequantized when it is quantized; with ``names``,
    only those (a plain checkpoint reads no other tensor; a quantized one dequantizes no other)."""
    if "quantization_config" not in config:
        return iter_tensors(files, names)
    return dequantized_tensors(config, files, names)


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All HF-named weights of a model folder, dequantized when it is quantized."""
    config = json.loads((path / "config.json").read_text())
    return dict(checkpoint_tensors(config, weight_files(path)))


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model on the folder's weights (dequantized ones for a quantized folder):
    the golden implementation for a checkpoint, without the compressed-tensors package."""
    import transformers

    config = json.loads((path / "config.json").read_text())
    if "quantization_config" not in config:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config.pop("quantization_config")
    cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sd = state_dict(path)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not fit transformers' model: {missing[:3]} {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model
