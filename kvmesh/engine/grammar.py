"""Grammar-constrained decoding: compile a request's constraint once, mask its logits every step.

A ``GrammarMatcher`` per constrained sequence tracks where its output is in the
grammar. Before sampling, the matcher fills one bitmask row per logits row the
sequence owns (one, or k+1 with speculator drafts: row i is the state after
drafts ``d_0..d_{i-1}``, so the drafts are fed to the matcher and rolled back
again), and forbidden tokens get ``-inf``. Greedy and sampled decoding then
can only pick allowed tokens, a forbidden draft is always rejected, and
accepted tokens advance the matcher as they are appended.

Masks are filled on the CPU between launching the forward pass and reading
its logits (``Masks``): the forward does not need them, only sampling does,
so on a GPU they cost no step time.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidArgument
from kvmesh.structured.grammar import build as build_grammar
from kvmesh.structured.spec import GrammarSpec

# Distinct constraints kept compiled (a compiled grammar holds per-token tables: ~KBs to MBs).
CACHE_ENTRIES = 256


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer.json, without loading transformers.

    ``vocab_size`` is the model's (its lm_head may be padded past the tokenizer's vocabulary).
    """
    vocab = tokenizer.vocab()
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    # How tokens spell bytes (byte-level, byte fallback or raw), read from the tokenizer.json
    # (xgrammar's own detector; the only way to it without a transformers tokenizer object).
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_json())
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=sorted(stop_token_ids),
        add_prefix_space=meta["add_prefix_space"],
    )


class GrammarCache:
    """Compiles constraints against one model's vocabulary; each distinct one once (LRU).

    Thread-safe: services compile off the engine thread (``AsyncEngine.generate``) so a
    slow schema never stalls a step, and the engine then finds it cached.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        # xgrammar's own cache is off: ours is keyed by the spec and bounded in entries.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = GrammarStats()

    def compiled(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
                return hit
        start = time.perf_counter()
        grammar = self._compile(spec)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        grammar = build_grammar(spec)  # InvalidArgument for anything xgrammar would refuse or not enforce
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise InvalidArgument(f"{spec.kind}: cannot compile for this model's vocabulary: {e}") from None

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled(spec))

    def allows(self, matcher: xgr.GrammarMatcher, token: int) -> bool:
        """Whether ``token`` may come next (the matcher is not changed)."""
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def allowed_prefix(matcher: xgr.GrammarMatcher, drafts: list[int]) -> list[int]:
    """The longest prefix of ``drafts`` the grammar allows (verifying the rest would be wasted work)."""
    n = 0
    for t in drafts:
        if not matcher.accept_token(t):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[:n]


@dataclass
class MaskRows:
    """One constrained sequence's rows in the batch's logits, and the drafts between them."""

    matcher: xgr.GrammarMatcher
    first_row: int
    drafts: list[int]


class Masks:
    """The bitmask rows of one step's constrained sequences.

    Filled on the CPU after the forward pass is launched and before its logits are read:
    on a GPU the kernels are still running then, so the masks cost no step time; on the
    CPU the fill is a few microseconds a row.
    """

    def __init__(self, num_rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._mask = xgr.allocate_token_bitmask(num_rows, vocab_size)
        self._indices: list[int] = []

    def fill(self, r: MaskRows) -> None:
        """Fill one constrained sequence's rows."""
        m = r.matcher
        accepted = 0
        for i in range(len(r.drafts) + 1):
            m.fill_next_token_bitmask(self._mask, r.first_row + i)
            self._indices.append(r.first_row + i)
            # A draft the grammar forbids ends this sequence's rows: verification rejects it
            # there (its logit is -inf), so later rows are never sampled from. So does one that
            # completes the grammar: the sequence finishes on it.
            if i == len(r.drafts) or not m.accept_token(r.drafts[i]):
                break
            accepted += 1
            if m.is_terminated():
                break
        if accepted:
            m.rollback(accepted)

    def apply(self, logits: torch.Tensor) -> int:
        """Mask ``logits`` [rows, V] in place (on their device); returns how many rows were masked."""
        if self._indices:
            mask = self._mask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=self._indices)
        return len(self._indices)
