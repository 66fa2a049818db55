"""Choosing each sequence's next token(s) from its logits.

Greedy rows are one batched argmax. Sampled rows apply temperature, top-k,
top-p and min-p, then draw with the request's own ``torch.Generator`` so a
seeded request is reproducible whatever else shares its batch. Logprobs are
those of the model's distribution (log-softmax of the logits, after the
request's own logit_bias, penalties and grammar mask; before temperature,
top-k, top-p and min-p).

A sequence with speculator drafts ``d_0..d_{k-1}`` owns k+1 rows: row i is the
model's distribution after the context plus ``d_0..d_{i-1}``. ``verify``
accepts the longest prefix of drafts the model agrees with and adds one token
of its own, so output is distributed exactly as without speculation:
- greedy: accept while ``d_i == argmax(row i)``; then emit ``argmax`` of the
  first disagreeing (or the bonus) row — the same tokens greedy decoding makes;
- sampled: drafts come from a deterministic proposer (a point mass ``q``), so
  standard speculative rejection sampling reduces to: accept ``d_i`` with
  probability ``p_i(d_i)``; on rejection draw from ``p_i`` with ``d_i``
  removed (the normalized residual ``max(0, p_i - q_i)``).
"""

from __future__ import annotations

import torch

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import TokenLogprob


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


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def verify(
    rows: torch.Tensor, drafts: list[int], params: SamplingParams, gen: torch.Generator, greedy_rows: list[int]
) -> list[int]:
    """Tokens to append for one sequence: accepted drafts plus one model token (1..k+1 tokens).

    ``rows`` [k+1, V] are its logits; ``greedy_rows`` their argmaxes (computed batched).
    """
    out: list[int] = []
    for i, draft in enumerate(drafts):
        if params.greedy:
            if greedy_rows[i] != draft:
                return out + [greedy_rows[i]]
        else:
            probs = filter_probs(rows[i], params)
            accept_p = float(probs[draft])
            if float(torch.rand((), generator=gen)) >= accept_p:
                residual = probs.clone()
                residual[draft] = 0.0
                return out + [_draw(residual / residual.sum(), gen)]
        out.append(draft)
    last = len(drafts)
    return out + [greedy_rows[last] if params.greedy else _draw(filter_probs(rows[last], params), gen)]


def token_logprobs(rows: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """Logprob of ``tokens[i]`` under row i, with the row's top ``n_top`` alternatives."""
    logprobs = torch.log_softmax(rows[: len(tokens)], dim=-1)
    out = []
    for row, tok in zip(logprobs, tokens):
        top = []
        if n_top > 0:
            vals, ids = torch.topk(row, n_top)
            top = list(zip(ids.tolist(), vals.tolist()))
        out.append(TokenLogprob(tok, float(row[tok]), top))
    return out
