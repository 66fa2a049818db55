"""``kvmesh models check PATH`` (the verb: kvmesh.verify.cli): whether kvmesh serves a model folder as
transformers computes it, before it is deployed. One table (kvmesh verify's), non-zero exit on any
failure, so it fits a release pipeline:

- the architecture is one kvmesh serves, and every config field is honoured or refused by name
  (kvmesh/checkpoint/config_fields.py); fields no table lists are named;
- the chat template renders a conversation with a tool; our tokenizer gives transformers' ids and
  decodes them back to the text;
- in float32, kvmesh's greedy tokens equal transformers' on a few prompts, and the mean top-k
  KL(transformers || kvmesh) over every step stays under a bound.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvmesh.checkpoint.config_fields import decided
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.errors import KvmeshError
from kvmesh.verify.checks import Check

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Ünïcödé, emoji 🚀 and numbers 12345 in one line.",
    "A list:\n- first\n- second\n\nDone.",
]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOP = 5


def check_model(path: Path, new_tokens: int = 16, max_kl: float = 1e-3) -> list[Check]:
    """The checks in order; a model whose config cannot be served stops after the first."""
    try:
        cfg = ModelConfig.from_dir(path)
    except KvmeshError as e:
        return [Check("architecture and config", "refused", False, str(e))]
    kv = f"{cfg.kv_bytes_per_token(2):,} B a token in 16 bits" + (" (MLA latent)" if cfg.mla is not None else "")
    checks = [Check("architecture", cfg.architecture, True), Check("KV cache", kv, True)]
    unknown = sorted(k for k in cfg.raw if not decided(k))
    checks.append(
        Check(
            "config fields",
            f"{len(cfg.raw) - len(unknown)} decided",
            True,
            f"not in the table (transformers' class does not read them either): {', '.join(unknown)}"
            if unknown
            else "",
        )
    )
    from transformers import AutoTokenizer

    from kvmesh.engine.tokenizer import Tokenizer

    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    checks.append(_template(ours))
    checks.append(_round_trip(ours, theirs))
    checks += _fidelity(path, ours, new_tokens, max_kl)
    return checks


def _template(tok) -> Check:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    try:
        text = tok.apply_chat_template(messages, tools=[TOOL])
    except KvmeshError as e:
        return Check("chat template (with a tool)", "fails", False, str(e))
    ok = "Weather in Paris?" in text
    return Check("chat template (with a tool)", f"{len(text)} chars", ok, "" if ok else "the user's text is missing")


def _round_trip(ours, theirs) -> Check:
    bad = []
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        if ids != theirs.encode(text, add_special_tokens=False) or ours.decode(ids) != text:
            bad.append(text[:20])
    return Check("tokenizer round-trip", f"{len(TEXTS) - len(bad)}/{len(TEXTS)}", not bad, "; ".join(map(repr, bad)))


def _fidelity(path: Path, tok, new_tokens: int, max_kl: float) -> list[Check]:
    from kvmesh.checkpoint.compressed import load_hf_model
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.sampling import SamplingParams

    prompts = [tok.encode(t) for t in TEXTS]
    engine = LLMEngine(path, EngineConfig(dtype="float32", num_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    served = engine.generate(prompts, params)
    engine.close()
    model = load_hf_model(path, torch.float32)
    identical, kls = 0, []
    for prompt, reply in zip(prompts, served):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        golden = out.sequences[0, len(prompt) :].tolist()
        identical += golden == reply.token_ids
        for logits, step in zip(out.logits, reply.logprobs):  # while both walked the same tokens
            lp = torch.log_softmax(logits[0].double(), -1)
            # Both distributions over kvmesh's top-k ids, each renormalized there: a KL that is never negative.
            golden_top = torch.log_softmax(lp[[i for i, _ in step.top]], -1)
            served_top = torch.log_softmax(torch.tensor([v for _, v in step.top], dtype=torch.double), -1)
            kls.append(float((golden_top.exp() * (golden_top - served_top)).sum()))
            if step.token_id != int(lp.argmax()):
                break
    kl = sum(kls) / len(kls) if kls else math.inf
    return [
        Check(
            "greedy vs transformers (float32)", f"{identical}/{len(prompts)} x {new_tokens}", identical == len(prompts)
        ),
        Check(f"top-{TOP} KL(transformers||kvmesh)", f"{kl:.2e}", kl <= max_kl, f"bound {max_kl:g}"),
    ]
