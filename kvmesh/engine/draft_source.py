"""The engine's seam for speculative decoding: what it calls to get drafts for its decoding sequences.

The engine verifies drafts (``kvmesh.engine.sampler.verify``: lossless, greedy or sampled); where they come
from and how many to ask for is ``kvmesh.speculation``'s, which implements this (``Drafter``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvmesh.engine.model import CausalLM
    from kvmesh.engine.sequence import Sequence


class DraftSource(Protocol):
    """Where the engine's speculative drafts come from: ``kvmesh.speculation.drafter.Drafter``, which asks
    a proposer for as many drafts per sequence as pay. Its calls, in order: ``bind(model)`` once the target
    is loaded (then ``wants_features``/``feature_layers`` say whether it reads the target's hidden states,
    from which layers), ``calibrate(model, kv_pool, max_model_len)`` before any block holds KV, then each
    step ``draft(decoding, vocab_size)`` (it sets ``seq.draft_ids``), ``verified(proposed, accepted)`` after
    each verify and ``finished(seq)`` when a request ends."""

    wants_features: bool
    feature_layers: tuple[int, ...]

    def bind(self, model: CausalLM) -> None: ...

    def calibrate(self, model: CausalLM, kv_cache: torch.Tensor, max_model_len: int) -> None: ...

    def draft(self, decoding: list[tuple[Sequence, int]], vocab_size: int) -> None: ...

    def verified(self, proposed: int, accepted: int) -> None: ...

    def finished(self, seq: Sequence) -> None: ...
