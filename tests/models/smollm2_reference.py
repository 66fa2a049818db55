"""The golden reference on the real default model: transformers, float32, on our converted folder.

Eight varied prompts (code, prose, non-ASCII, chat-templated) run greedily for 64
tokens with EOS ignored; for every step the reference keeps the chosen token, its top
logprobs and the gap between its two most likely tokens, so a comparison that
diverges can show whether it diverged on a near-tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from kvmesh.engine.default_model import default_model_path
from kvmesh.engine.tokenizer import Tokenizer

NEW_TOKENS = 64
TOP = 5
# A divergence is only acceptable where the reference's two best tokens are this close.
TIE = 1e-4
LOGPROB_TOLERANCE = 1e-3

RAW_PROMPTS = [
    "def fibonacci(n):",
    'import json\n\n\ndef load_config(path):\n    """Read a JSON config file and return it as a dict."""\n',
    "The history of the printing press begins in",
    "Once upon a time, in a small village by the sea, there lived",
    "Le café de la rue Saint-Honoré est célèbre pour ses croissants. 東京は",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the ocean."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain what a Python list comprehension is."},
    ],
]


@dataclass(frozen=True)
class Step:
    token: int
    top: list[tuple[int, float]]  # the TOP most likely (id, logprob), best first
    gap: float  # logprob of the best token minus the second best


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    steps: list[Step]

    @property
    def token_ids(self) -> list[int]:
        return [s.token for s in self.steps]


def prompts() -> list[list[int]]:
    tok = Tokenizer(default_model_path())
    raw = [tok.encode(p) for p in RAW_PROMPTS]
    chat = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in CHATS]
    return raw + chat


@lru_cache(maxsize=1)
def references() -> list[Reference]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every step: the engine's ignore_eos twin
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = []
    for prompt in prompts():
        ids = torch.tensor([prompt])
        with torch.no_grad():  # an explicit mask: inferred, it would hide the prompt's <|im_end|> (= pad)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        ids = gen.sequences[0, len(prompt) :].tolist()
        steps = []
        for logits, token in zip(gen.logits, ids):
            lp = torch.log_softmax(logits[0].double(), -1)
            vals, top_ids = torch.topk(lp, TOP)
            steps.append(Step(token, list(zip(top_ids.tolist(), vals.tolist())), float(vals[0] - vals[1])))
        out.append(Reference(prompt, steps))
    return out


def first_divergence(ref: Reference, got: list[int]) -> int | None:
    """The first step where ``got`` differs from the reference, checked to be a near-tie there."""
    assert len(got) == len(ref.steps), (len(got), len(ref.steps))
    for i, (step, token) in enumerate(zip(ref.steps, got)):
        if token != step.token:
            assert step.gap < TIE, (
                f"diverged at step {i}: got {token}, reference {step.token} with a margin of {step.gap:.2e} "
                f"(not a near-tie: top {step.top[:2]})"
            )
            return i
    return None
