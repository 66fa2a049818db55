"""Drafts from a small draft model, run by kvmesh's own engine.

A draft model shares the target's tokenizer and is trained to imitate it
(``train/distill_draft.py``), so its greedy continuation of a context is a
good guess at the target's. Each call adds one short greedy request per
context to a private ``LLMEngine`` and steps it until every draft is done;
all contexts of a call run batched.

Per-request state lives in the draft engine's prefix cache: the KV of every
full block a request's previous drafts computed stays cached under its
content hash, so the next call for the same request (same context plus a few
accepted tokens) recomputes only the last partial block and the new tokens,
not the whole context. Blocks of requests that ended are simply the least
recently used ones and are evicted first.

Use it in-process as a ``DraftProposer`` (kvmesh.speculation.drafter) (``propose``/``finished``),
or from the speculator service with plain token lists (``draft``).
Not thread-safe: call it from one thread (the engine's, or the service's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sequence import Sequence
from kvmesh.sampling import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    context: list[int]  # the request's tokens so far (prompt + output)
    num_tokens: int  # draft length wanted


def draft_engine_config(device: str = "cpu") -> EngineConfig:
    """The draft engine's default set-up on ``device``."""
    # A pool of ~16k tokens of draft KV: plenty of room to keep recent requests'
    # prefixes cached between calls.
    return EngineConfig(device=device, num_blocks=1024, max_num_batched_tokens=2048)


class DraftModelProposer:
    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, max_draft_tokens: int = 8) -> None:
        self.engine = LLMEngine(model_path, config or draft_engine_config())
        self.max_draft_tokens = max_draft_tokens
        self._calls = itertools.count()

    def draft(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Greedy drafts of up to ``num_tokens`` tokens for each request (fewer near the
        draft model's context limit; none for an empty context)."""
        engine = self.engine
        call = next(self._calls)
        owners: dict[str, str] = {}
        try:
            for r in requests:
                k = min(r.num_tokens, self.max_draft_tokens, engine.max_model_len - len(r.context))
                if k <= 0 or not r.context:
                    continue
                # A fresh id per call: the previous call's draft request has finished.
                rid = f"{r.request_id}#{call}"
                engine.add_request(r.context, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True), rid)
                owners[rid] = r.request_id
        except Exception:
            # A context the draft model cannot take (e.g. ids outside its vocabulary):
            # leave the draft engine as it was, with nothing half-queued.
            for rid in owners:
                engine.abort(rid)
            raise
        drafts: dict[str, list[int]] = {owner: [] for owner in owners.values()}
        while engine.has_unfinished():
            for out in engine.step():
                drafts[owners[out.request_id]].extend(out.new_token_ids)
        return drafts

    # -- the DraftProposer protocol (kvmesh.speculation.drafter) ----------------

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        return self.draft([DraftRequest(seq.request_id, seq.all_ids, k) for seq, k in wants])

    def finished(self, seq: Sequence) -> None:
        """Nothing to drop: the request's cached blocks age out of the draft pool by LRU."""
