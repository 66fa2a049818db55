"""Choosing each sequence's next token(s) from its logits.

Greedy rows are one batched argmax. Sampled rows apply temperature, top-k,
top-p and min-p, then draw. A seeded request draws output position i from a
generator keyed by (seed, i) alone (``position_generator``): its text depends
neither on what else shares its batch nor on where its earlier tokens were
sampled, so a stream handed from prefill to decode, or resumed on another
worker after a migration, samples what one unbroken run would have. Logprobs are
those of the model's distribution (log-softmax of the logits, after the
request's own logit_bias, penalties and grammar mask; before temperature,
top-k, top-p and min-p).

A sequence with speculator drafts ``d_0..d_{k-1}`` owns k+1 rows: row i is the
model's distribution after the context plus ``d_0..d_{i-1}``. ``verify``
accepts the longest prefix of drafts the model agrees with and adds one token
of its own, so output is distributed exactly as without speculation:
- greedy: accept while ``d_i == argmax(row i)``; then emit ``argmax`` of the
  first disagreeing (or the bonus) row — the same tokens greedy decoding makes;
- sampled: standard speculative rejection sampling. A draft drawn from a
  distribution ``q_i`` (``draft_probs``, e.g. an EAGLE head sampling) is
  accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; on rejection the
  token is drawn from the normalized residual ``max(0, p_i - q_i)``. Without
  ``draft_probs`` the draft counts as a point mass: accept with ``p_i(d_i)``,
  else draw from ``p_i`` with ``d_i`` removed. The point-mass rule is exact for
  a draft chosen in any way independent of this step's random draws (a
  proposer's guess); the ``q`` rule accepts more when drafts really are
  samples from ``q``;
- sampled, ``exact`` (deterministic serving): row i draws its token exactly as
  plain decoding draws position i (the same distribution, the same generator),
  and drafts are accepted while they equal those draws. The text is then the
  same bits with speculation on or off, with any draft source; fewer drafts are
  accepted than by rejection sampling (a draft must be the very token drawn).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.sequence import TokenLogprob
from kvmesh.sampling import SamplingParams


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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# Streams of one seed: the draws that pick output tokens, and an EAGLE head's draft draws
# (independent of the first, as rejection sampling needs).
TOKENS, DRAFTS = 0, 1


def position_generator(seed: int, position: int, stream: int = TOKENS) -> torch.Generator:
    """The generator of output position ``position`` (0: the first generated token) of a request
    seeded ``seed``: a function of those alone, as a counter-based generator's draws are."""
    key = _mix64(_mix64(_mix64(seed & _MASK64) ^ stream) ^ position)
    return torch.Generator().manual_seed(key >> 1)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def verify(
    rows: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    gens: Sequence[torch.Generator],
    greedy_rows: list[int],
    draft_probs: torch.Tensor | None = None,
    exact: bool = False,
) -> list[int]:
    """Tokens to append for one sequence: accepted drafts plus one model token (1..k+1 tokens).

    ``rows`` [k+1, V] are its logits; ``gens`` [k+1] the generators of their output positions
    (unused when greedy); ``greedy_rows`` their argmaxes (computed batched); ``draft_probs`` [k, V]
    the distributions the drafts were sampled from (None: point masses); ``exact``: a sampled row
    keeps the token plain decoding draws (module docstring).
    """
    out: list[int] = []
    for i, draft in enumerate(drafts):
        if params.greedy:
            if greedy_rows[i] != draft:
                return out + [greedy_rows[i]]
        elif exact:
            drawn = _draw(filter_probs(rows[i], params), gens[i])
            if drawn != draft:
                return out + [drawn]
        else:
            probs = filter_probs(rows[i], params)
            q = draft_probs[i] if draft_probs is not None else None
            accept_p = float(probs[draft]) if q is None else min(1.0, float(probs[draft]) / max(float(q[draft]), 1e-30))
            if float(torch.rand((), generator=gens[i])) >= accept_p:
                if q is None:
                    residual = probs.clone()
                    residual[draft] = 0.0
                else:
                    residual = (probs - q.to(probs.dtype)).clamp_(min=0.0)
                # Zero only when p == q, where rejection cannot happen (float dust aside): draw from p then.
                total = float(residual.sum())
                return out + [_draw(residual / total if total > 0 else probs, gens[i])]
        out.append(draft)
    last = len(drafts)
    return out + [greedy_rows[last] if params.greedy else _draw(filter_probs(rows[last], params), gens[last])]


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
