"""Greedy generation with Hugging Face transformers: the golden reference."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def _model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every step; the engine's ignore_eos twin
    return model


def greedy_steps(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` greedy tokens of a transformers (or PEFT) model, EOS not special-cased, and each step's
    log-probabilities over the vocabulary."""
    from transformers import GenerationConfig

    # No EOS: generation runs exactly n steps without suppressing any token's logit.
    config = GenerationConfig(
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
    ids = out.sequences[0, len(prompt) :].tolist()
    return ids, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def hf_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens (EOS not special-cased) and each one's log-probability."""
    ids, steps = greedy_steps(_model(str(path)), prompt, n)
    return ids, [lp[t].item() for lp, t in zip(steps, ids)]
