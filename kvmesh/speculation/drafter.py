"""``Drafter``: the engine's speculation. It asks a proposer for as many drafts per sequence as pay.

The engine knows only this object's methods (``kvmesh.engine.engine.LLMEngine(drafter=...)``): it binds
the target to it once loaded, lets it price verifies before any block holds KV, asks it each step for the
drafts of the decoding sequences, and reports what each verify accepted. The proposer behind it (the
speculator service's client, ``LocalProposer``, an EAGLE head, a draft model) only drafts; how many drafts
a sequence gets is the draft-length policy's (``draft_length``), priced by ``verify_cost`` on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import structlog
import torch

from kvmesh.engine.grammar import allowed_prefix
from kvmesh.speculation.draft_length import DraftLengthPolicy
from kvmesh.speculation.verify_cost import measure_draft_costs

if TYPE_CHECKING:
    from kvmesh.engine.model import CausalLM
    from kvmesh.engine.sequence import Sequence

log = structlog.get_logger(__name__)


class DraftProposer(Protocol):
    """Where speculative drafts come from (the speculator service, a local n-gram index, a head).

    A proposer that reads the target (an EAGLE head) has a ``bind(model)`` method, called once the model
    is loaded, and a true ``wants_features``: it then finds each sequence's target feature in
    ``seq.feature``, the final hidden state of the row that sampled its last token, or the outputs of the
    target's layers it names in ``feature_layers`` (read after ``bind``), concatenated. One whose drafting
    takes time on the engine thread says how much with ``draft_seconds(k)`` (k drafts for one sequence,
    read after ``bind``), so verifies are priced with it.
    """

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to k draft tokens per (sequence, k); may return fewer or none (late answers)."""
        ...

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: its output can teach the proposer."""
        ...


class Drafter:
    """``proposer``'s drafts, at most ``max_k`` a sequence; ``costs``: a verify of 1, 2, ... drafts in
    decode steps' time at every batch size (None: measured on CPU at ``calibrate``, free elsewhere;
    (): free, always ``max_k``)."""

    def __init__(self, proposer: DraftProposer, max_k: int, costs: tuple[float, ...] | None = None) -> None:
        if max_k < 1:
            raise ValueError(f"a drafter asks for at least one draft, got max_k={max_k}")
        self.proposer = proposer
        self.max_k = max_k
        self._costs = costs
        self._policy = DraftLengthPolicy(max_k, {1: tuple(costs) if costs is not None else ()})

    @property
    def wants_features(self) -> bool:
        return bool(getattr(self.proposer, "wants_features", False))

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(getattr(self.proposer, "feature_layers", ()))

    @property
    def costs(self) -> dict[int, tuple[float, ...]]:
        """Per batch size, a verify of 1, 2, ... drafts in decode steps' time (a step of n sequences is
        priced by the table of the largest size <= n)."""
        return self._policy.costs

    def bind(self, model: CausalLM) -> None:
        """The target is loaded (before its decode step is compiled: the features it returns are traced
        with it)."""
        if hasattr(self.proposer, "bind"):
            self.proposer.bind(model)

    def calibrate(self, model: CausalLM, kv_cache: torch.Tensor, max_model_len: int) -> None:
        """Price verifies where no table was given: measured on CPU, where a verify row costs what the
        processor makes it; free on a GPU, where verify rows are nearly free at small batch. Before any
        block holds KV: the probe writes pool blocks."""
        if self._costs is None and kv_cache.device.type == "cpu":
            draft_seconds = getattr(self.proposer, "draft_seconds", None)
            self._policy.costs = measure_draft_costs(model, kv_cache, self.max_k, max_model_len, draft_seconds)

    def draft(self, decoding: list[tuple[Sequence, int]], vocab_size: int) -> None:
        """Give a step's decoding sequences their drafts (``seq.draft_ids``, and ``seq.draft_probs`` where
        they were sampled from a distribution). Each comes with its ``room`` (tokens it may still add beside
        the bonus token) and gets as many as pay for a step of this batch, at most ``room``; drafts outside
        the vocabulary or, for a constrained sequence, past what its grammar allows are cut off."""
        wants = {}
        for seq, room in decoding:
            if room > 0:
                k = self._policy.choose(seq.num_draft_accepted, seq.num_draft_missed, room, len(decoding))
                wants[seq.request_id] = (seq, k)
        if not wants:
            return
        try:
            proposed = self.proposer.propose(list(wants.values()))
        except Exception:  # drafts are an optimization: a failing proposer costs this step's, no request
            log.exception("the draft proposer failed; this step runs without drafts")
            return
        for rid, drafts in proposed.items():
            seq, k = wants.get(rid, (None, 0))
            if seq is None:
                continue
            try:
                self._take(seq, drafts, k, vocab_size)
            except Exception:
                log.exception("drafts a sequence could not take; it runs without", request_id=rid)
                seq.draft_ids, seq.draft_probs = [], None

    def _take(self, seq: Sequence, drafts: list[int], k: int, vocab_size: int) -> None:
        # Drafts sampled from a distribution (an EAGLE head's) carry it as ``probs``.
        probs = getattr(drafts, "probs", None)
        kept = [t for t in drafts[:k] if 0 <= t < vocab_size]
        seq.draft_ids = allowed_prefix(seq.grammar, kept) if seq.grammar is not None else kept
        # Rows stay aligned only if no token was dropped before the kept ones; otherwise the point-mass
        # rule verifies them (exact for any draft, see kvmesh.engine.sampler.verify).
        aligned = probs is not None and seq.draft_ids == list(drafts[: len(seq.draft_ids)])
        seq.draft_probs = probs[: len(seq.draft_ids)] if aligned else None

    def verified(self, proposed: int, accepted: int) -> None:
        """A verify of ``proposed`` drafts accepted ``accepted`` of them (the policy learns the rate)."""
        self._policy.record(proposed, accepted)

    def finished(self, seq: Sequence) -> None:
        self.proposer.finished(seq)
