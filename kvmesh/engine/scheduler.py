"""Continuous batching: which sequences run this step, with how many tokens each.

Every step has a token budget. Running sequences go first, in arrival order:
a decoding sequence takes one token, a sequence still prefilling takes the
next chunk of its prompt that fits. Waiting sequences then join the batch
while budget and sequence slots remain, reusing every leading full block
already in the prefix cache. When KV blocks run out, the most recently
admitted running sequence is preempted: its blocks are released (their
cached names survive for a cheap recompute) and it waits at the front of the
queue to be recomputed. A sequence under a LoRA adapter joins only when its
adapter has a slot (``kvmesh.engine.lora``); while every slot is held, it waits
and the sequences behind it that need no new slot join instead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvmesh.blocks import block_hashes
from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.lora import LoraAdapters
from kvmesh.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens each sequence computes this step

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora: LoraAdapters | None = None,
        window: int = 0,
    ) -> None:
        """``window``: where every layer attends to at most the last ``window`` tokens, a running
        sequence's blocks wholly before the window of its next query are released as it advances (they
        stay in the prefix cache until evicted); 0: a sequence holds all its blocks."""
        self.blocks = blocks
        self.window = window
        self.block_size = block_size
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.draft_ids and seq.num_tokens - seq.num_computed + len(seq.draft_ids) > budget:
                seq.draft_ids = []  # drafts never squeeze out a plain decode
            n = min(seq.num_tokens - seq.num_computed + len(seq.draft_ids), budget)
            while not self._reserve(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            i += 1
        # New work joins only when nothing was just preempted for lack of blocks.
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[w]
            if not self._hold_adapter_slot(seq):
                w += 1  # every slot is held by running sequences: the next may not need one
                continue
            self._claim_cached_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve(seq, n):
                self._release(seq)
                break
            del self.waiting[w]
            if seq.admissions == 0:  # not a recompute after preemption
                seq.admitted_ns = time.perf_counter_ns()
                seq.num_cached_prompt = seq.num_computed
                self.num_cached_prompt_tokens += seq.num_computed
            seq.admissions += 1
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        return batch

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Advance computed counts past the verified tokens and name the blocks they filled.

        Draft tokens' KV is written too but only counts once verification accepts it
        (``accept_drafts``); a rejected draft's slot is simply overwritten later.
        """
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n - len(seq.draft_ids)
            self.register_full_blocks(seq)
            self._drop_out_of_window(seq)

    def accept_drafts(self, seq: Sequence, n_accepted: int) -> None:
        seq.num_computed += n_accepted
        self.register_full_blocks(seq)
        self._drop_out_of_window(seq)

    def finish(self, seq: Sequence, reason: str, keep_prompt_blocks: bool = False) -> list[tuple[bytes, int]]:
        """End a sequence and release its blocks, except — with ``keep_prompt_blocks`` — its
        computed full prompt blocks, returned as (hash, block id) with their references kept."""
        seq.finish_reason = reason
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        kept: list[tuple[bytes, int]] = []
        if keep_prompt_blocks:
            n = min(len(seq.prompt_ids), seq.num_computed) // self.block_size
            kept = list(zip(self._hashes_upto(seq, n), seq.block_table[:n]))
            seq.block_table = seq.block_table[n:]
        self._release(seq)
        if seq.adapter is not None:
            self.lora.drop(seq.adapter)
        return kept

    # -- internals -------------------------------------------------------

    def _hashes_upto(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        have = len(seq.block_hashes)
        if have < n_blocks:
            bs = self.block_size
            ids = seq.all_ids[have * bs : n_blocks * bs]
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes.extend(block_hashes(ids, bs, seq.fingerprint, seq.cache_salt, parent))
        return seq.block_hashes[:n_blocks]

    def _claim_cached_prefix(self, seq: Sequence) -> None:
        if seq.block_table:
            return
        # At least one token must run through the model to produce logits, so never match
        # the block holding the last token.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        cached = self.blocks.match_prefix(self._hashes_upto(seq, max_blocks))
        self.blocks.acquire(cached)
        seq.block_table = list(cached)
        seq.num_named_blocks = len(cached)
        seq.num_computed = len(cached) * self.block_size

    def _hold_adapter_slot(self, seq: Sequence) -> bool:
        if seq.adapter is None or seq.lora_slot >= 0:
            return True
        slot = self.lora.acquire(seq.adapter)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _reserve(self, seq: Sequence, n: int) -> bool:
        need = -(-(seq.num_computed + n) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Release the blocks no query of ``seq`` reads again: its next query sits at ``num_computed`` (drafts
        rejected or not) and sees keys after ``num_computed - window``. A sequence holding its prompt for a
        hand-off keeps every block."""
        if not self.window or seq.hold_prompt_blocks:
            return
        dead = max(0, seq.num_computed - self.window + 1) // self.block_size
        if dead <= seq.num_dropped_blocks:
            return
        self.blocks.release(seq.block_table[seq.num_dropped_blocks : dead])
        seq.block_table[seq.num_dropped_blocks : dead] = [0] * (dead - seq.num_dropped_blocks)
        seq.num_dropped_blocks = dead

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table[seq.num_dropped_blocks :])
        seq.block_table = []
        seq.num_computed = 0
        seq.num_named_blocks = 0
        seq.num_dropped_blocks = 0
        if seq.lora_slot >= 0:
            self.lora.release(seq.lora_slot)
            seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.block_size
        if full <= seq.num_named_blocks:
            return
        hashes = self._hashes_upto(seq, full)
        for idx in range(seq.num_named_blocks, full):
            self.blocks.register(seq.block_table[idx], hashes[idx])
        seq.num_named_blocks = full
