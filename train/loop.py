"""Pieces both training scripts share: the step/time budget, the LR schedule, evaluation."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM


@dataclass
class Budget:
    """Training stops at ``max_steps`` or after ``minutes``, whichever comes first.

    Progress (which drives the LR schedule) is the larger of the two fractions:
    on a fast, idle machine the run is step-bound and reproduces exactly; on a
    busy one it becomes time-bound and still finishes its LR decay in time.
    """

    max_steps: int
    minutes: float
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def progress(self, step: int) -> float:
        return max(step / self.max_steps, self.elapsed_s / (self.minutes * 60))

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


def lr_at(step: int, progress: float, peak: float, warmup_steps: int, floor: float = 0.1) -> float:
    """Linear warmup, then cosine decay to ``floor * peak`` as progress goes 0 -> 1."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return peak * (floor + (1 - floor) * cos)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm gains and nothing else are left alone)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, windows: torch.Tensor, batch: int = 8) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats/token) over every window, in float32; and tokens scored."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch].to(model.device)
        logits = model(input_ids=x).logits.float()
        total += F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += x[:, 1:].numel()
    model.train()
    return total / count, count
