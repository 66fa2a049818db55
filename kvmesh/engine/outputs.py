"""What the engine hands back: each step's output per request (``RequestOutput``), a finished request
(``Completion``, from ``LLMEngine.generate``), its counters (``EngineStats``), and the failure
``EngineConfig.fault_after_steps`` injects."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.sequence import TokenLogprob
from kvmesh.errors import KvmeshError


class InjectedFault(RuntimeError):
    """The failure ``EngineConfig.fault_after_steps`` injects: one no request owns."""


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    new_logprobs: list[TokenLogprob]
    num_prompt_tokens: int
    num_cached_tokens: int
    # Of new_token_ids, how many were speculator drafts the model accepted.
    num_draft_accepted: int = 0
    # time.perf_counter_ns() when the request was added and when it was first scheduled (0: not yet, e.g.
    # a remote prefill's first token): the wait between is its queue time.
    added_ns: int = 0
    admitted_ns: int = 0
    # Times it was preempted (its KV dropped and recomputed), and drafts proposed for it, so far.
    num_preemptions: int = 0
    num_draft_proposed: int = 0
    # Set when the request failed (finish_reason "error"): what its caller gets instead of tokens.
    error: KvmeshError | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0  # of which served from the prefix cache
    computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    generated_tokens: int = 0
    imported_blocks: int = 0
    exported_blocks: int = 0
    preemptions: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    grammar_masked_rows: int = 0  # logits rows masked by a request's grammar
    grammar_mask_seconds: float = 0.0  # engine-thread time spent filling and applying those masks
    failed_requests: int = 0  # requests a failure of their own ended (the step went on for the others)


@dataclass
class Completion:
    """A finished request, as ``generate`` returns it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
