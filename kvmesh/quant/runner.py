"""The model a fidelity run evaluates: transformers on the folder's weights, with any plan's
fake-quantized weights swapped in (quantize -> dequantize: exactly what dequant-on-load serves)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvmesh.checkpoint.compressed import Plan, linear_modules, load_hf_model
from kvmesh.checkpoint.formats import fake_quantize


class HFRunner:
    """A logit source (ids [T] -> logits [T, V]) whose quantization plan can be changed in place."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        self.model = load_hf_model(path, dtype)
        self.dtype = dtype
        names = [n for n, _ in self.model.named_parameters()]
        self.modules = linear_modules(names)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self._head = "model.embed_tokens" if self.tied else "lm_head"
        self._original = {m: self._param(m).detach().clone() for m in [*self.modules, "lm_head"]}
        self.plan: Plan = {}

    def _param(self, module: str) -> torch.nn.Parameter:
        return self.model.get_submodule(self._head if module == "lm_head" else module).weight

    def params(self, module: str) -> int:
        return self._original[module].numel()

    def apply(self, plan: Plan) -> None:
        """Make the model compute with ``plan``'s weights (every other module at its original)."""
        for module, original in self._original.items():
            if plan.get(module) != self.plan.get(module):
                fmt = plan.get(module)
                self._param(module).data.copy_(original if fmt is None else fake_quantize(fmt, original))
        self.plan = dict(plan)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids[None]).logits[0].float()

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int = 96) -> list[int]:
        """Greedy answer ids, stopping at EOS (kept) or ``max_new_tokens``."""
        out = self.model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=self.model.config.eos_token_id or 0,
        )  # fmt: skip
        return out[0, len(prompt) :].tolist()
