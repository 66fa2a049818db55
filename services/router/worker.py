"""What the router knows about a worker: its role, KV layout, capacity and load.

Plain frozen dataclasses shared by the registry (which stores them), the policy
(which weighs them) and the servicer (which converts them from protobuf).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class Role(enum.Enum):
    PREFILL = "prefill"
    # A decode worker can also prefill locally when the router decides so.
    DECODE = "decode"
    # The kvstore: registers so its blocks (tier KVSTORE) count as the
    # cluster-wide cache. It stores opaque bytes of any layout, so it has none
    # to check, and it never runs a request.
    KVSTORE = "kvstore"

    @property
    def runs_requests(self) -> bool:
        return self is not Role.KVSTORE


@dataclass(frozen=True)
class KVLayout:
    """How a worker lays out one KV block; blocks only move between equal layouts."""

    block_size: int
    dtype: str
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: bytes

    def first_mismatch(self, other: KVLayout) -> str | None:
        """Name of the first field where ``other`` differs from this layout, if any."""
        for f in dataclasses.fields(self):
            if getattr(self, f.name) != getattr(other, f.name):
                return f.name
        return None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["model_fingerprint"] = self.model_fingerprint.hex()
        return d

    @classmethod
    def from_json(cls, d: dict) -> KVLayout:
        return cls(**{**d, "model_fingerprint": bytes.fromhex(d["model_fingerprint"])})


@dataclass(frozen=True)
class WorkerCapacity:
    total_kv_blocks: int
    max_num_seqs: int = 0
    max_model_len: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker announces when it registers."""

    worker_id: str
    role: Role
    address: str
    # None for the kvstore (see ``Role.KVSTORE``).
    layout: KVLayout | None
    capacity: WorkerCapacity
    model: str = ""

    def to_json(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "role": self.role.value,
            "address": self.address,
            "layout": self.layout.to_json() if self.layout is not None else None,
            "capacity": dataclasses.asdict(self.capacity),
            "model": self.model,
        }

    @classmethod
    def from_json(cls, d: dict) -> WorkerInfo:
        return cls(
            worker_id=d["worker_id"],
            role=Role(d["role"]),
            address=d["address"],
            layout=KVLayout.from_json(d["layout"]) if d["layout"] is not None else None,
            capacity=WorkerCapacity(**d["capacity"]),
            model=d.get("model", ""),
        )


@dataclass(frozen=True)
class AdapterState:
    """A LoRA adapter a worker has loaded."""

    name: str
    # The root of its blocks' hash chain (kvmesh.blocks.adapter_fingerprint).
    fingerprint: bytes
    resident: bool  # in one of the worker's adapter slots


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as its last heartbeat reported it."""

    queued_requests: int = 0
    active_sequences: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    # Prompt tokens still to prefill plus tokens still to decode.
    tokens_in_flight: int = 0
    adapters: tuple[AdapterState, ...] = ()

    def adapter(self, name: str) -> AdapterState | None:
        return next((a for a in self.adapters if a.name == name), None)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["adapters"] = [{**a, "fingerprint": a["fingerprint"].hex()} for a in d["adapters"]]
        return d

    @classmethod
    def from_json(cls, d: dict) -> WorkerLoad:
        adapters = tuple(
            AdapterState(a["name"], bytes.fromhex(a["fingerprint"]), a["resident"]) for a in d.get("adapters", ())
        )
        return cls(**{**d, "adapters": adapters})
