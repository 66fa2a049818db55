"""LoRA adapters written by PEFT itself on a test checkpoint, and greedy generation through
transformers + PEFT on them: the golden reference for adapters."""

from __future__ import annotations

from pathlib import Path

import torch

from .hf_reference import greedy_steps

# name -> LoraConfig settings: the default Llama targets, every projection with rslora, and a rank
# and alpha per module (rank_pattern / alpha_pattern), so each way PEFT scales is exercised.
ADAPTERS = {
    "qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all-rslora": {
        "r": 16,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "mlp-patterns": {
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["o_proj", "gate_proj", "down_proj"],
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"gate_proj": 12},
    },
}


def write_peft_adapter(base: Path, out: Path, seed: int, **settings) -> Path:
    """A PEFT LoRA adapter for the checkpoint ``base``, with random non-zero B (PEFT starts B at 0):
    factors of unit gain, so an adapter's product is a fraction of its projection's, as trained ones are."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **settings))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int, top: int = 5):
    """``n`` greedy tokens and, per token, the top-``top`` (token, logprob) pairs, with the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids, steps = greedy_steps(model, prompt, n)
    tops = []
    for lp in steps:
        values, tokens = lp.topk(top)
        tops.append(list(zip(tokens.tolist(), values.tolist())))
    return ids, tops
