"""One fidelity session over a model: the eval set, the cached reference, the noise floor, and
the evaluation of any plan against them. ``kvmesh quantize`` and bench/quantization.py share it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvmesh.checkpoint.compressed import Plan
from kvmesh.checkpoint.files import weight_files, weights_id
from kvmesh.checkpoint.formats import UNQUANTIZED_BITS, get_format
from kvmesh.quant import evalset, fidelity, search
from kvmesh.quant.runner import HFRunner

DEFAULT_CACHE = Path.home() / ".cache" / "kvmesh" / "quant"
Log = Callable[[str], None]


@contextmanager
def one_thread() -> Iterator[None]:
    """Evaluate on one CPU thread: on a shared, oversubscribed CPU two threads ran SmolLM2's forward
    2-4x slower than one (every parallel op waits for its slowest thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class FidelitySession:
    def __init__(self, model: Path, eval_tokens: int, cache_dir: Path = DEFAULT_CACHE, chunk_len: int = 512,
                 prompts: tuple[str, ...] = evalset.CHAT_PROMPTS, log: Log = print) -> None:  # fmt: skip
        from transformers import AutoTokenizer

        self.model_path, self.log = model, log
        torch.manual_seed(0)
        self.runner = HFRunner(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        key = f"{weights_id(weight_files(model))}-{eval_tokens}-{chunk_len}-{len(prompts)}"
        self.cache = cache_dir / key
        chunks_file = self.cache / "evalset.pt"
        if chunks_file.is_file():
            chunks = torch.load(chunks_file)
        else:
            log(f"[quant] building the eval set ({len(prompts)} chat answers + stdlib text, >= {eval_tokens} tokens)")
            chunks = evalset.build(tokenizer, self.runner.generate, eval_tokens, chunk_len, prompts)
            self.cache.mkdir(parents=True, exist_ok=True)
            torch.save(chunks, chunks_file)
        vocab = int(self.runner.model.config.vocab_size)
        self.ref = fidelity.ReferenceCache(self.cache / "reference.f32", chunks, vocab)
        t0 = time.perf_counter()
        self.ref.build(self.runner, lambda i, n: log(f"[quant] reference log-probs {i}/{n}") if i % 10 == 0 else None)
        self.seconds_per_pass = time.perf_counter() - t0
        self.info = {
            "model": str(model), "eval_tokens": self.ref.shape[0], "eval_chunks": len(chunks),
            "chat_prompts": len(prompts), "evalset_fingerprint": evalset.fingerprint(chunks),
        }  # fmt: skip
        self._noise: dict[str, Any] | None = None

    def total_params(self) -> int:
        return sum(self.runner.params(m) for m in self.runner.modules)

    def avg_bits(self, plan: Plan) -> float:
        """Stored bits per weight of the decoder's projections (the LM head counts when planned)."""
        mods = [*self.runner.modules, *(["lm_head"] if "lm_head" in plan else [])]
        total = sum(self.runner.params(m) for m in mods)
        stored = sum(
            self.runner.params(m) * (get_format(plan[m]).bits if m in plan else UNQUANTIZED_BITS) for m in mods
        )
        return stored / total

    def stats(self, plan: Plan, chunks: list[int] | None = None) -> fidelity.TokenStats:
        self.runner.apply(plan)
        try:
            return fidelity.evaluate(self.ref, self.runner, chunks)
        finally:
            self.runner.apply({})

    def report(self, plan: Plan) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = fidelity.report(self.stats(plan))
        return {**r, "bits": self.avg_bits(plan), "seconds": time.perf_counter() - t0}

    def noise_floor(self) -> dict[str, Any]:
        """The same weights computed in bf16 against fp32: the KL below which nothing is visible."""
        if self._noise is None:
            bf16 = HFRunner(self.model_path, torch.bfloat16)
            self._noise = {**fidelity.report(fidelity.evaluate(self.ref, bf16)), "bits": UNQUANTIZED_BITS}
        return self._noise

    def search(self, formats: Sequence[str], budgets: Sequence[float], layers_per_group: int,
               search_chunks: int, max_trials: int) -> dict[str, Any]:  # fmt: skip
        """Sensitivities once, then for each budget the additive plan and its local search."""
        groups = search.layer_groups(self.runner.modules, self.runner.params, layers_per_group)

        subset = fidelity.spread(len(self.ref.chunks), search_chunks)

        def measure(plan: Plan) -> float:
            return float(self.stats(plan, subset).kl.mean())

        self.log(f"[quant] sensitivity of {len(groups)} layer groups x {len(formats)} formats")
        sens = search.sensitivities(groups, formats, measure)
        out: dict[str, Any] = {
            "groups": [{"name": g.name, "params": g.params} for g in groups],
            "sensitivity": {f"{g}:{f}": v for (g, f), v in sens.items()},
            "search_tokens": sum(len(self.ref.chunks[i]) - 1 for i in subset),
            "budgets": {},
        }
        for budget in budgets:
            start = search.additive_plan(groups, sens, formats, budget)
            if start is None:
                raise ValueError(f"no plan fits {budget} bits per weight with {', '.join(formats)}")
            self.log(f"[quant] budget {budget}: additive plan {start}; local search")
            res = search.local_search(groups, sens, formats, start, measure, max_trials)
            out["budgets"][str(budget)] = {
                "additive": res.additive, "final": res.final, "predicted_kl": res.predicted_kl, "trials": res.trials,
                "plan": search.plan_of(groups, res.final),
            }  # fmt: skip
        return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
