"""Which adapter each token of a step uses, in the two forms the LoRA product needs.

A step's tokens come grouped by sequence, so the tokens of one adapter form runs ("segments"). The
Triton kernel walks the segments (one program per segment and output tile); the torch reference
masks one batched product instead (a 0/1 mask that keeps, for each token, only its own slot's rank
columns). Both are built once per step and shared by every adapted projection of every layer.
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
    num_slots: int  # slots 0..num_slots-1 cover every slot in use (the columns a product reads)
    rank: int  # rank columns per slot
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, slot_runs: list[tuple[int, int]], rank: int, device: torch.device) -> LoraSegments | None:
        """From (slot, tokens) per sequence in batch order; None when no token uses an adapter."""
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
        if not slots:
            return None

        def ints(v: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(v, dtype=dtype, device=device)

        return cls(
            ints(per_token, torch.long),
            ints(starts, torch.int32),
            ints(lens, torch.int32),
            ints(slots, torch.int32),
            max(slots) + 1,
            rank,
        )

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[T, num_slots * rank]: 1 where the column belongs to the token's own slot."""
        m = self._masks.get(dtype)
        if m is None:
            cols = torch.arange(self.num_slots * self.rank, device=self.token_slots.device) // self.rank
            m = self._masks[dtype] = (self.token_slots[:, None] == cols[None, :]).to(dtype)
        return m
