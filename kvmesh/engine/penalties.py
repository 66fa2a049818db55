"""Logit adjustments a request asks for: the min_tokens mask, logit_bias, then the penalties.

Applied to the raw logits before grammar masks and sampling (greedy picks the
argmax of the adjusted row), in vLLM's order: bias first, then penalties.
- ``logit_bias``: added to the named tokens' logits (OpenAI).
- ``repetition_penalty`` (transformers' RepetitionPenaltyLogitsProcessor): every token
  seen in the prompt or the output has its logit divided by the penalty when positive,
  multiplied when negative.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI): over the *generated* tokens,
  ``logit -= count * frequency + (count > 0) * presence``.
- ``min_tokens`` (vLLM): until that many tokens are out, the tokens that would end the
  sequence (EOS unless ``ignore_eos``, ``stop_token_ids``) get -inf, so they cannot be sampled.

A row that verifies drafts sees the drafts before it as already generated, so
speculation changes nothing. Per sequence the counts live in dense [V] tensors on the
logits' device, caught up with the tokens appended since the last step: a step costs a
few vector ops per adjusted row, however long the sequence.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvmesh.sampling import SamplingParams


@dataclass
class PenaltyState:
    """A sequence's token counts as the penalties need them."""

    output_counts: torch.Tensor  # [V] float32: occurrences in the output
    seen: torch.Tensor  # [V] bool: in the prompt or the output
    bias_ids: torch.Tensor  # the request's logit_bias as tensors, built once, not per row and step
    bias_values: torch.Tensor
    early_stop_ids: torch.Tensor  # masked while fewer than min_tokens tokens are out
    num_counted: int = 0  # output tokens already in output_counts

    @classmethod
    def new(
        cls,
        prompt_ids: list[int],
        params: SamplingParams,
        vocab_size: int,
        device: torch.device,
        eos_ids: Collection[int] = (),
    ) -> PenaltyState:
        """``eos_ids``: the model's end tokens, which min_tokens masks unless the request ignores EOS."""
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        early = torch.tensor(sorted(ends), dtype=torch.long, device=device)
        return cls(torch.zeros(vocab_size, dtype=torch.float32, device=device), seen, bias_ids, bias_values, early)

    def catch_up(self, output_ids: list[int]) -> None:
        new = output_ids[self.num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.seen.device)
            self.output_counts.index_add_(0, ids, torch.ones(len(new), device=ids.device))
            self.seen[ids] = True
            self.num_counted = len(output_ids)


def adjust_row(row: torch.Tensor, params: SamplingParams, state: PenaltyState, drafts: list[int]) -> None:
    """Adjust one logits row [V] in place; ``drafts`` are the draft tokens before this row."""
    if state.num_counted + len(drafts) < params.min_tokens:
        row[state.early_stop_ids] = float("-inf")
    if params.logit_bias:
        row.index_add_(0, state.bias_ids, state.bias_values.to(row.dtype))
    counts, seen = state.output_counts, state.seen
    if drafts:
        ids = torch.tensor(drafts, dtype=torch.long, device=row.device)
        counts = counts.index_add(0, ids, torch.ones(len(drafts), device=row.device))
        seen = seen.clone()
        seen[ids] = True
    if params.repetition_penalty != 1.0:
        p = params.repetition_penalty
        row.copy_(torch.where(seen, torch.where(row < 0, row * p, row / p), row))
    if params.frequency_penalty:
        row.sub_(counts * params.frequency_penalty)
    if params.presence_penalty:
        row.sub_((counts > 0).to(row.dtype) * params.presence_penalty)
