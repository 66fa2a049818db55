"""LoRA adapters on one engine: loaded at any time, a bounded number resident, many in one step.

``LoraAdapters`` keeps every loaded adapter in host memory (float32, as read) and copies up to
``max_loras`` of them into *slots*: per fused projection of ours (qkv, o, gate_up, down), one stack per
layer holding every slot's factors (``A`` [slots, width, in], ``B`` [slots, width, out]). A slot's
``width`` is ``max_lora_rank`` per Hugging Face projection fused in it (q, k and v: three): their ``A``s
stacked and their ``B``s block-diagonal, so a fused projection's adapted parts are one product pair
(one call per projection and step: on a CPU, calls cost more than the zero blocks); lower ranks and
parts an adapter does not target are zeros. A running sequence holds its adapter's slot; a free slot goes to
the least recently used adapter no sequence holds (the adapter stays loaded, in host memory). A step
binds which slot each token uses (``LoraSegments``) and every decoder layer adds, after each base
projection, the product of each token's own slot through the one ``lora_delta`` op.

Thread-safety: ``load``/``unload``/``list`` are called from a service's event loop while the engine
thread schedules and steps; one lock covers the registry and the slot table.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import Ops
from kernels.lora_segments import LoraSegments
from kvmesh.blocks import adapter_fingerprint
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.checkpoint.peft_adapter import PeftAdapter, load_peft_adapter, projection_shape
from kvmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

# A name a request's ``model`` can carry and a URL path can hold.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    # The fingerprint its blocks are chained with (kvmesh.blocks.adapter_fingerprint).
    fingerprint: bytes
    resident: bool  # in a slot now


def fused_parts(cfg: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Our fused projections -> the Hugging Face projections in them: (name, output offset, width)."""
    q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
        "o_proj": [("o_proj", 0, cfg.hidden_size)],
        "gate_up_proj": [("gate_proj", 0, i), ("up_proj", i, i)],
        "down_proj": [("down_proj", 0, cfg.hidden_size)],
    }


class LoraAdapters:
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        max_rank: int,
        model_fingerprint: bytes,
    ) -> None:
        if max_loras <= 0 or max_rank <= 0:
            raise InvalidArgument(f"max_loras and max_lora_rank must be positive, got {max_loras}, {max_rank}")
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.max_loras, self.rank = max_loras, max_rank
        self.model_fingerprint = model_fingerprint
        self.parts = fused_parts(cfg)
        # Our fused projection -> (A [layers, slots, width, in], B [layers, slots, width, out]); made when
        # the first adapter that targets a part of it is loaded.
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # This step's tokens -> slots (None: no token uses an adapter), and the fused projections the
        # adapters in those slots target: set by ``bind_step`` around a forward.
        self.segments: LoraSegments | None = None
        self._step_modules: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._adapters: dict[str, PeftAdapter] = {}
        self._users: Counter[str] = Counter()  # requests (queued or running) under each adapter
        self._slot_of: dict[str, int] = {}
        self._slot_refs = [0] * max_loras  # running sequences holding each slot
        self._slot_name: list[str | None] = [None] * max_loras
        self._slot_modules: list[frozenset[str]] = [frozenset()] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0

    # -- the registry (any thread) --------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read, check and register an adapter; loading the same files under the same name again is a
        no-op. InvalidArgument names what is wrong with the files; AlreadyExists for a name taken by
        other files."""
        if not _NAME.fullmatch(name):
            raise InvalidArgument(
                f"adapter name {name!r}: use 1-128 letters, digits and ._:/- (a letter or digit first)"
            )
        adapter = load_peft_adapter(path, self.cfg, self.rank)  # off the lock: it reads files
        with self._lock:
            old = self._adapters.get(name)
            if old is not None and old.fingerprint != adapter.fingerprint:
                raise AlreadyExists(f"adapter {name!r} is already loaded from {old.path}; unload it first")
            for module in self._fused_targets(adapter):
                self._ensure_stack(module)
            self._adapters[name] = adapter
            return self._info(name)

    def unload(self, name: str) -> None:
        """Forget an adapter; FailedPrecondition while requests use it, NotFound if it is not loaded."""
        with self._lock:
            if name not in self._adapters:
                raise NotFound(f"adapter {name!r} is not loaded")
            if self._users[name]:
                raise FailedPrecondition(f"adapter {name!r} serves {self._users[name]} request(s); unload it after")
            del self._adapters[name]
            slot = self._slot_of.pop(name, None)
            if slot is not None:
                self._slot_name[slot] = None

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(n) for n in sorted(self._adapters)]

    def chain_fingerprint(self, name: str) -> bytes:
        with self._lock:
            self._get(name)
            return self._info(name).fingerprint

    # -- requests (the engine thread) ------------------------------------------------------------

    def hold(self, name: str) -> None:
        """A request under ``name`` was queued: it may not be unloaded until ``drop``."""
        with self._lock:
            self._get(name)
            self._users[name] += 1

    def drop(self, name: str) -> None:
        with self._lock:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]

    def acquire(self, name: str) -> int | None:
        """A slot holding ``name`` for one more running sequence: its own if resident, else a free one
        (the least recently used adapter no sequence holds leaves it). None when every slot is held."""
        with self._lock:
            self._clock += 1
            slot = self._slot_of.get(name)
            if slot is None:
                idle = [s for s in range(self.max_loras) if self._slot_refs[s] == 0]
                if not idle:
                    return None
                slot = min(idle, key=lambda s: (self._slot_name[s] is not None, self._last_used[s]))
                if self._slot_name[slot] is not None:
                    del self._slot_of[self._slot_name[slot]]
                adapter = self._get(name)
                self._upload(adapter, slot)
                self._slot_name[slot], self._slot_of[name] = name, slot
                self._slot_modules[slot] = self._fused_targets(adapter)
            self._slot_refs[slot] += 1
            self._last_used[slot] = self._clock
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._slot_refs[slot] -= 1

    # -- the forward ----------------------------------------------------------------------------

    def bind_step(self, slot_runs: list[tuple[int, int]], device: torch.device) -> None:
        """Bind the next forward's tokens to slots: (slot or -1, tokens) per sequence in batch order."""
        self.segments = LoraSegments.build(slot_runs, device)
        self._step_modules = frozenset().union(*(self._slot_modules[s] for s, _ in slot_runs if s >= 0))

    def unbind_step(self) -> None:
        self.segments, self._step_modules = None, frozenset()

    def add(self, ops: Ops, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to ``y`` (the output of our fused projection ``module`` at ``layer``, in place) each
        token's adapter product of its input ``x``."""
        # Only projections some adapter of this step targets: the others' factors are all zeros here.
        if module in self._step_modules:
            stack = self.stacks[module]
            ops.lora_add(y, x, stack[0][layer], stack[1][layer], self.segments)

    # -- internals ----------------------------------------------------------------------------------

    def _get(self, name: str) -> PeftAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound(f"adapter {name!r} is not loaded on this worker")
        return adapter

    def _fused_targets(self, adapter: PeftAdapter) -> frozenset[str]:
        """Our fused projections with a part ``adapter`` targets."""
        targeted = {module for _, module in adapter.targets}
        return frozenset(fused for fused, parts in self.parts.items() if any(p in targeted for p, _, _ in parts))

    def _info(self, name: str) -> AdapterInfo:
        a = self._adapters[name]
        fp = adapter_fingerprint(self.model_fingerprint, a.fingerprint)
        return AdapterInfo(name, str(a.path), a.rank, fp, name in self._slot_of)

    def _ensure_stack(self, module: str) -> None:
        if module not in self.stacks:
            parts = self.parts[module]
            n_in = projection_shape(self.cfg, parts[0][0])[0]
            n_out = sum(width for _, _, width in parts)
            shape = (self.cfg.num_layers, self.max_loras, len(parts) * self.rank)
            kw = {"dtype": self.dtype, "device": self.device}
            self.stacks[module] = (torch.zeros(*shape, n_in, **kw), torch.zeros(*shape, n_out, **kw))

    def _upload(self, adapter: PeftAdapter, slot: int) -> None:
        for module, (a_stack, b_stack) in self.stacks.items():
            a_stack[:, slot] = 0
            b_stack[:, slot] = 0
            for p, (part, offset, width) in enumerate(self.parts[module]):
                row = p * self.rank
                for layer in range(self.cfg.num_layers):
                    target = adapter.targets.get((layer, part))
                    if target is not None:
                        r = target.rank
                        a_stack[layer, slot, row : row + r] = target.a.to(self.dtype)
                        b_stack[layer, slot, row : row + r, offset : offset + width] = target.b.t().to(self.dtype)
