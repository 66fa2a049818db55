"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from kvmesh.blocks import BlockHash
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.penalties import PenaltyState
from kvmesh.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: bytes = b""
    # The chain root of its block hashes (kvmesh.blocks): the model's, or under ``adapter`` the
    # adapter's (kvmesh.blocks.adapter_fingerprint).
    fingerprint: bytes = b""
    # The LoRA adapter it runs under (None: the base model) and the slot holding it while running
    # (-1: none; kvmesh.engine.lora).
    adapter: str | None = None
    lora_slot: int = -1
    arrival: int = 0  # admission order, for FCFS and preemption choice
    # time.perf_counter_ns() when the request was added, and when it was first scheduled (0: not yet):
    # its queue wait, for its trace and its caller's timings.
    added_ns: int = field(default_factory=time.perf_counter_ns)
    admitted_ns: int = 0
    # The request's W3C trace context (None: untraced), for services that act on it later (the speculator).
    traceparent: str | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (prefix hits included).
    num_computed: int = 0
    # Leading blocks of block_table already named in the prefix cache.
    num_named_blocks: int = 0
    # Leading blocks of block_table released because every layer's window has passed them (their
    # entries point at block 0, which no query reads: kvmesh.engine.scheduler).
    num_dropped_blocks: int = 0
    admissions: int = 0  # >1 after preemption
    # Prompt tokens served from the prefix cache at (first) admission.
    num_cached_prompt: int = 0
    # Hashes of this sequence's full blocks, in order (extended as blocks fill).
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: str | None = None
    # A seeded request's generator for an EAGLE head's draft draws (kvmesh.engine.sampler.DRAFTS).
    draft_generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    # Keep the prompt's full blocks referenced after finishing (a prefill worker's hand-off).
    hold_prompt_blocks: bool = False
    # Speculator drafts to verify in the next step (cleared after it).
    draft_ids: list[int] = field(default_factory=list)
    # The distributions [k, V] the drafts were sampled from (None: point masses, the usual case).
    draft_probs: torch.Tensor | None = None
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    # Verifies that ended in a rejected draft (kvmesh.speculation.draft_length estimates from these).
    num_draft_missed: int = 0
    # The target's final hidden state at the row that sampled the last token (set only for a
    # proposer that wants features: an EAGLE head drafts from it).
    feature: torch.Tensor | None = None
    # A failure of this sequence's own in the runner's part of a step (its penalties, its grammar
    # mask): the engine fails the request after the forward (LLMEngine._fail).
    error: Exception | None = None
    # Where the output is in the request's grammar (None: unconstrained).
    grammar: xgr.GrammarMatcher | None = None
    # Text already handed to the caller (stop strings are held back until resolved).
    emitted_text_len: int = 0
    # Token counts for logit_bias / penalties (None: the request asks for none, or not yet sampled).
    penalties: PenaltyState | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_decoding(self) -> bool:
        """All but the last token are in the cache: the next step samples."""
        return self.num_computed == self.num_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
