"""Which adapter each token of a step uses, in the two forms the LoRA product needs.

A step's tokens come grouped by sequence, so the tokens of one adapter form runs ("segments"). The
Triton kernel walks the segments (one program per segment and output tile). The torch reference
gathers each slot's tokens into one row of a batch instead (``groups``: slot s's tokens, padded to
the largest group), for a batched product per projection whatever the number of adapters; with
one slot in use it needs no gather, only a mask of the tokens that use it. All of it is built once
per step and shared by every adapted projection of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraSegments:
    token_slots: torch.Tensor  # [T] long: the adapter slot of each token, -1 for none
    seg_start: torch.Tensor  # [S] int32: first token of each run that uses an adapter
    seg_len: torch.Tensor  # [S] int32
    seg_slot: torch.Tensor  # [S] int32
    num_slots: int  # slots 0..num_slots-1 cover every slot in use (the factors a product reads)
    # [num_slots, G]: the tokens of each slot (padding repeats token 0), and [num_slots, G, 1] 1 for a
    # real token, 0 for padding.
    groups: torch.Tensor
    group_valid: torch.Tensor
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, slot_runs: list[tuple[int, int]], device: torch.device) -> LoraSegments | None:
        """From (slot, tokens) per sequence in batch order; None when no token uses an adapter."""
        if all(slot < 0 for slot, _ in slot_runs):
            return None  # the usual step of a worker with adapters loaded but none asked for: no per-token work
        starts, lens, slots, per_token = [], [], [], []
        pos = 0
        for slot, n in slot_runs:
            if slot >= 0 and n:
                if slots and slots[-1] == slot and starts[-1] + lens[-1] == pos:
                    lens[-1] += n
                else:
                    starts.append(pos)
                    lens.append(n)
                    slots.append(slot)
            per_token.extend([slot] * n)
            pos += n

        def ints(v: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(v, dtype=dtype, device=device)

        num_slots = max(slots) + 1
        members: list[list[int]] = [[] for _ in range(num_slots)]
        for t, slot in enumerate(per_token):
            if slot >= 0:
                members[slot].append(t)
        g = max(len(m) for m in members)
        return cls(
            ints(per_token, torch.long),
            ints(starts, torch.int32),
            ints(lens, torch.int32),
            ints(slots, torch.int32),
            num_slots,
            ints([m + [0] * (g - len(m)) for m in members], torch.long),
            ints([[[1.0]] * len(m) + [[0.0]] * (g - len(m)) for m in members], torch.float32),
        )

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[T, 1]: 1 for the tokens that use slot 0 (the one slot in use when ``num_slots`` is 1)."""
        m = self._masks.get(dtype)
        if m is None:
            m = self._masks[dtype] = (self.token_slots == 0).to(dtype)[:, None]
        return m
