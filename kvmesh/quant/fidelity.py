"""How faithfully one model reproduces another, token by token: the KL report.

One definition, reused by ``kvmesh quantize``, the plan search and the benchmark: a reference
and a test *logit source* (token ids [T] -> float logits [T, V]) run over the same evaluation
chunks, and for every scored position we keep the full-vocabulary KL(ref || test), whether
the top-1 tokens agree, the probability each gives the text's actual next token, and both
negative log-likelihoods. The fields are llama.cpp ``--kl-divergence``'s: mean/p99/max KL,
same-top-1 rate, RMS Δp of the reference token, PPL ratio. Intervals: Wilson for the top-1
rate; for the rest a bootstrap over chunks (tokens of one chunk are not independent).

The reference's log-probs are computed once and cached on disk in float32 (full vocabulary;
top-k plus logsumexp cannot give the full-vocab KL), so each test config costs one forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

LogitSource = Callable[[torch.Tensor], torch.Tensor]  # ids [T] -> logits [T, V]
BOOTSTRAP_SAMPLES = 1000
Z95 = 1.959964


@dataclass
class TokenStats:
    """Per scored position: KL, top-1 agreement, p of the next token under both, chunk index."""

    kl: np.ndarray
    same_top1: np.ndarray
    p_ref: np.ndarray
    p_test: np.ndarray
    chunk: np.ndarray

    @staticmethod
    def concat(parts: Sequence[TokenStats]) -> TokenStats:
        return TokenStats(*(np.concatenate([getattr(p, f) for p in parts]) for f in TokenStats.__dataclass_fields__))


def compare_logprobs(ref_lp: torch.Tensor, test_logits: torch.Tensor, next_ids: torch.Tensor, chunk: int) -> TokenStats:
    """Stats of one chunk from reference log-probs [T, V] and test logits [T, V] (float32)."""
    test_lp = torch.log_softmax(test_logits.float(), dim=-1)
    ref_lp = ref_lp.float()
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1).clamp_min(0.0)
    same = ref_lp.argmax(-1) == test_lp.argmax(-1)
    rows = torch.arange(len(next_ids))
    return TokenStats(
        kl=kl.double().numpy(),
        same_top1=same.numpy(),
        p_ref=ref_lp[rows, next_ids].exp().double().numpy(),
        p_test=test_lp[rows, next_ids].exp().double().numpy(),
        chunk=np.full(len(next_ids), chunk),
    )


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _metrics(s: TokenStats, idx: np.ndarray | None = None) -> dict[str, float]:
    """The point values over positions ``idx`` (all when None)."""
    kl, pr, pt = (s.kl, s.p_ref, s.p_test) if idx is None else (s.kl[idx], s.p_ref[idx], s.p_test[idx])
    nll_ref, nll_test = -np.log(np.maximum(pr, 1e-300)), -np.log(np.maximum(pt, 1e-300))
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "rms_dp": float(np.sqrt(np.mean((pt - pr) ** 2))),
        "ppl_ratio": float(math.exp(nll_test.mean() - nll_ref.mean())),
    }


def report(s: TokenStats, seed: int = 0) -> dict[str, Any]:
    """The report dict: point values, 95% intervals, counts."""
    n = len(s.kl)
    point = _metrics(s)
    rng = np.random.default_rng(seed)
    chunks = np.unique(s.chunk)
    members = {c: np.flatnonzero(s.chunk == c) for c in chunks}
    boots: dict[str, list[float]] = {k: [] for k in point}
    for _ in range(BOOTSTRAP_SAMPLES):
        picked = rng.choice(chunks, size=len(chunks), replace=True)
        m = _metrics(s, np.concatenate([members[c] for c in picked]))
        for k, v in m.items():
            boots[k].append(v)
    same = int(s.same_top1.sum())
    out: dict[str, Any] = {"tokens": n, "chunks": len(chunks), "kl_max": float(s.kl.max())}
    for k, v in point.items():
        lo, hi = np.quantile(boots[k], [0.025, 0.975])
        out[k] = v
        out[f"{k}_ci95"] = [float(lo), float(hi)]
    out["same_top1"] = same / n
    out["same_top1_ci95"] = list(wilson(same, n))
    return out


class ReferenceCache:
    """The reference's log-probs of every scored position, float32 on disk, one row per position."""

    def __init__(self, path: Path, chunks: Sequence[torch.Tensor], vocab: int) -> None:
        self.chunks = list(chunks)
        self.offsets = np.cumsum([0] + [len(c) - 1 for c in self.chunks])
        self.path = path
        self.shape = (int(self.offsets[-1]), vocab)

    def build(self, reference: LogitSource, progress: Callable[[int, int], None] | None = None) -> None:
        if self.path.is_file() and self.path.stat().st_size == 4 * self.shape[0] * self.shape[1]:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        mm = np.memmap(tmp, dtype=np.float32, mode="w+", shape=self.shape)
        for i, ids in enumerate(self.chunks):
            lp = torch.log_softmax(reference(ids[:-1]).float(), dim=-1)
            mm[self.offsets[i] : self.offsets[i + 1]] = lp.numpy()
            if progress:
                progress(i + 1, len(self.chunks))
        mm.flush()
        del mm
        tmp.rename(self.path)

    def logprobs(self, i: int) -> torch.Tensor:
        mm = np.memmap(self.path, dtype=np.float32, mode="r", shape=self.shape)
        return torch.from_numpy(np.array(mm[self.offsets[i] : self.offsets[i + 1]]))


def spread(n: int, k: int | None) -> list[int]:
    """``k`` chunk indices spread evenly over ``n`` (all when k is None or >= n): a search subset
    that mixes chat answers and text."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)})


def evaluate(ref: ReferenceCache, test: LogitSource, chunks: list[int] | None = None) -> TokenStats:
    """Run ``test`` over the cached reference's chunks (those indexed by ``chunks``; all when None)."""
    parts = []
    for i in range(len(ref.chunks)) if chunks is None else chunks:
        ids = ref.chunks[i]
        parts.append(compare_logprobs(ref.logprobs(i), test(ids[:-1]), ids[1:], i))
    return TokenStats.concat(parts)


def format_rows(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """The printed table: one row per config."""
    head = (
        f"{'config':<28} {'bits':>5} {'KL mean [95% CI]':>30} {'KL p99':>9} {'KL max':>8} "
        f"{'same top1 [95% CI]':>26} {'RMS dp':>7} {'PPL ratio':>9}"
    )
    lines = [head, "-" * len(head)]
    for name, r in rows:
        lo, hi = r["kl_mean_ci95"]
        tlo, thi = r["same_top1_ci95"]
        bits = r.get("bits")
        lines.append(
            f"{name:<28} {'' if bits is None else f'{bits:.2f}':>5} "
            f"{r['kl_mean']:>10.5f} [{lo:.5f}, {hi:.5f}] {r['kl_p99']:>9.5f} {r['kl_max']:>8.4f} "
            f"{100 * r['same_top1']:>7.2f}% [{100 * tlo:.2f}, {100 * thi:.2f}] "
            f"{100 * r['rms_dp']:>6.2f}% {r['ppl_ratio']:>9.4f}"
        )
    return "\n".join(lines)
