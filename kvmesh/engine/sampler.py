"""Choosing the next token of each sequence from its logits.

Greedy rows are one batched argmax. Sampled rows apply temperature, top-k,
top-p and min-p, then draw with the request's own ``torch.Generator`` so a
seeded request is reproducible whatever else shares its batch. Logprobs are
those of the model's distribution (log-softmax of the raw logits).
"""

from __future__ import annotations

import torch

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Sequence, TokenLogprob


def filter_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution [V] after temperature, top-k, top-p and min-p."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, seqs: list[Sequence], default_gen: torch.Generator) -> list[int]:
    """One token per row of ``logits`` [N, V] (float32); appends logprobs where asked."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            probs = filter_probs(logits[i], seq.params)
            gen = seq.generator or default_gen
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    if any(s.params.logprobs is not None for s in seqs):
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, seq in enumerate(seqs):
            n_top = seq.params.logprobs
            if n_top is None:
                continue
            row = logprobs[i]
            top = []
            if n_top > 0:
                vals, ids = torch.topk(row, n_top)
                top = list(zip(ids.tolist(), vals.tolist()))
            seq.logprobs.append(TokenLogprob(tokens[i], float(row[tokens[i]]), top))
    return tokens
