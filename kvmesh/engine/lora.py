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

Under tensor parallelism (kvmesh.engine.tensor_parallel) every rank adds its own part of each delta
``B @ A``: a column-parallel projection's slice of B's rows, a row-parallel one's slice of A's columns
(``TPLayout.lora_factors``), whose partial products the layer's all-reduce sums as it sums the base
product's. Rank 0 keeps the registry and the slot table; when it fills a slot it sends each follower that
slot's factors (``LoraSlots.write_slot`` there), and each step's binding travels with the step.

Thread-safety: ``load``/``unload``/``list`` are called from a service's event loop while the engine
thread schedules and steps; one lock covers the registry and the slot table.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import Ops
from kernels.lora_segments import LoraSegments
from kvmesh.blocks import adapter_fingerprint
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.checkpoint.peft_adapter import PeftAdapter, load_peft_adapter, projection_shape
from kvmesh.engine.tp_layout import TPLayout
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


# One slot's factors per fused projection: module -> (A [layers, width, in], B [layers, width, out]).
SlotFactors = dict[str, tuple[torch.Tensor, torch.Tensor]]
# Rank 0's messenger to a follower: (rank, slot, that rank's factors for the slot).
SendSlot = Callable[[int, int, SlotFactors], None]


class LoraSlots:
    """The forward's side of LoRA on one rank: every slot's factors, stacked per fused projection, and
    which slot each token of the step uses. A follower rank holds only this (filled by rank 0)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, max_loras: int) -> None:
        self.dtype, self.device, self.max_loras = dtype, device, max_loras
        # Our fused projection -> (A [layers, slots, width, in], B [layers, slots, width, out]); made when
        # the first adapter that targets a part of it is loaded.
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # This step's tokens -> slots (None: no token uses an adapter), and the fused projections the
        # adapters in those slots target: set by ``bind_step`` around a forward.
        self.segments: LoraSegments | None = None
        self.step_modules: frozenset[str] = frozenset()

    def binding(self) -> tuple[LoraSegments, frozenset[str]] | None:
        """This step's binding, as a follower needs it (None: no token uses an adapter)."""
        return None if self.segments is None else (self.segments, self.step_modules)

    def bind(self, binding: tuple[LoraSegments, frozenset[str]] | None) -> None:
        self.segments, self.step_modules = binding if binding is not None else (None, frozenset())

    def add(self, ops: Ops, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to ``y`` (the output of our fused projection ``module`` at ``layer``, in place) each
        token's adapter product of its input ``x``."""
        # Only projections some adapter of this step targets: the others' factors are all zeros here.
        if module in self.step_modules:
            stack = self.stacks[module]
            ops.lora_add(y, x, stack[0][layer], stack[1][layer], self.segments)

    def write_slot(self, slot: int, factors: SlotFactors) -> None:
        """Put one slot's factors in place (a stack is made the first time a projection is targeted)."""
        for module, (a, b) in factors.items():
            if module not in self.stacks:
                layers, width = a.shape[0], a.shape[1]
                kw = {"dtype": self.dtype, "device": self.device}
                self.stacks[module] = (
                    torch.zeros(layers, self.max_loras, width, a.shape[2], **kw),
                    torch.zeros(layers, self.max_loras, width, b.shape[2], **kw),
                )
            self.stacks[module][0][:, slot] = a
            self.stacks[module][1][:, slot] = b


class LoraAdapters(LoraSlots):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        max_rank: int,
        model_fingerprint: bytes,
        layouts: list[TPLayout] | None = None,
        send_slot: SendSlot | None = None,
    ) -> None:
        """``layouts``: every rank's (rank 0 first) under tensor parallelism, ``send_slot`` delivering the
        followers' factors; None: one rank."""
        if max_loras <= 0 or max_rank <= 0:
            raise InvalidArgument(f"max_loras and max_lora_rank must be positive, got {max_loras}, {max_rank}")
        super().__init__(dtype, device, max_loras)
        self.layouts: list[TPLayout | None] = list(layouts) if layouts else [None]
        self.cfg, self.rank = cfg, max_rank
        self.model_fingerprint = model_fingerprint
        self.parts = fused_parts(cfg)
        self._send_slot = send_slot
        self._lock = threading.Lock()
        self._adapters: dict[str, PeftAdapter] = {}
        self._users: Counter[str] = Counter()  # requests (queued or running) under each adapter
        self._slot_of: dict[str, int] = {}
        self._slot_refs = [0] * max_loras  # running sequences holding each slot
        self._slot_name: list[str | None] = [None] * max_loras
        self._slot_modules: list[frozenset[str]] = [frozenset()] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0
        # The fused projections some loaded adapter targets: each slot's factors cover all of them.
        self._targeted: set[str] = set()

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
            self._targeted |= self._fused_targets(adapter)
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
        modules = frozenset().union(*(self._slot_modules[s] for s, _ in slot_runs if s >= 0))
        self.bind((LoraSegments.build(slot_runs, device), modules))

    def unbind_step(self) -> None:
        self.bind(None)

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

    def _upload(self, adapter: PeftAdapter, slot: int) -> None:
        """Fill ``slot`` with ``adapter`` on every rank: this one's stacks, the followers' by message."""
        for rank, layout in enumerate(self.layouts):
            factors = self._slot_factors(adapter, layout)
            if rank == 0:
                self.write_slot(slot, factors)
            else:
                self._send_slot(rank, slot, factors)

    def _slot_factors(self, adapter: PeftAdapter, layout: TPLayout | None) -> SlotFactors:
        """``adapter``'s factors for one slot of the rank with ``layout``, per fused projection any loaded
        adapter targets (zeros where this one does not): their A's stacked, their B's block-diagonal."""
        cfg = layout.local_config(self.cfg) if layout is not None else self.cfg
        parts, out = fused_parts(cfg), {}
        for module in sorted(self._targeted):
            n_in = projection_shape(cfg, parts[module][0][0])[0]
            n_out = sum(width for _, _, width in parts[module])
            shape = (cfg.num_layers, len(parts[module]) * self.rank)
            a, b = torch.zeros(*shape, n_in, dtype=self.dtype), torch.zeros(*shape, n_out, dtype=self.dtype)
            for p, (part, offset, width) in enumerate(parts[module]):
                row = p * self.rank
                for layer in range(cfg.num_layers):
                    target = adapter.targets.get((layer, part))
                    if target is not None:
                        fa, fb = target.a, target.b
                        if layout is not None:
                            fa, fb = layout.lora_factors(part, fa, fb)
                        a[layer, row : row + target.rank] = fa.to(self.dtype)
                        b[layer, row : row + target.rank, offset : offset + width] = fb.t().to(self.dtype)
            out[module] = (a, b)
        return out
