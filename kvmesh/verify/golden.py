"""The golden side of ``kvmesh verify``: transformers on the model folder's weights (with a LoRA
adapter: transformers + PEFT on the adapter's files)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.checkpoint.compressed import load_hf_model


@dataclass
class GoldenReply:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[torch.Tensor]  # per generated step: full-vocab log-probs [V]
    finish_reason: str  # "stop" (EOS) or "length"


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in for each byte, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTE_DECODER = _byte_decoder()


def _token_bytes(tokenizer, i: int) -> bytes:
    piece = tokenizer.convert_ids_to_tokens(i)
    if piece and all(ch in _BYTE_DECODER for ch in piece) and i not in tokenizer.all_special_ids:
        return bytes(_BYTE_DECODER[ch] for ch in piece)
    return tokenizer.decode([i]).encode()


class Golden:
    def __init__(self, path: Path, adapter: Path | None = None) -> None:
        from transformers import AutoTokenizer

        self.path, self.adapter = path, adapter
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = load_hf_model(path, torch.float32)
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter).eval()
        eos = self.model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id} - {None}
        # Each token's raw bytes and the UTF-8 of its decoded text: an endpoint's logprobs name
        # tokens by one or the other (kvmesh's gateway, like some others, sends the text's bytes,
        # so a partial UTF-8 token arrives as U+FFFD). bytes -> id skips byte strings ids share.
        n = len(self.tokenizer)
        self.token_bytes = [_token_bytes(self.tokenizer, i) for i in range(n)]
        self.token_keys = [{b, self.tokenizer.decode([i]).encode()} for i, b in enumerate(self.token_bytes)]
        seen: dict[bytes, set[int]] = {}
        for i, keys in enumerate(self.token_keys):
            for b in keys:
                seen.setdefault(b, set()).add(i)
        self.bytes_to_id = {b: next(iter(ids)) for b, ids in seen.items() if len(ids) == 1}

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @torch.inference_mode()
    def greedy(self, messages: list[dict], max_tokens: int) -> GoldenReply:
        prompt = self.prompt_ids(messages)
        out = self.model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(self.eos),
            pad_token_id=sorted(self.eos)[0], output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        ids = out.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
        finish = "stop" if ids and ids[-1] in self.eos else "length"
        return GoldenReply(prompt, ids, logprobs, finish)
