"""Shared helpers for the kvstore core tests: real block hashes, random payloads."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvmesh.blocks import block_hashes
from services.kvstore.block import Block
from services.kvstore.core import KvStore

BLOCK_SIZE = 16


@pytest.fixture
def chain() -> Callable[[int], list[bytes]]:
    """``chain(n)``: the hashes of an n-block prompt, as the engine names them."""

    def make(n: int) -> list[bytes]:
        return block_hashes(list(range(n * BLOCK_SIZE)), BLOCK_SIZE, fingerprint=b"test-model")

    return make


@pytest.fixture
def make_block() -> Callable[..., Block]:
    """``make_block(nbytes, seed=0)``: a block of random bytes."""

    def make(nbytes: int, seed: int = 0) -> Block:
        return Block.build(random.Random(seed).randbytes(nbytes), shape=[nbytes], dtype="uint8")

    return make


class EventLog:
    """An ``on_event`` callback that records what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[bytes]]] = []

    def __call__(self, kind: str, hashes: list[bytes]) -> None:
        self.events.append((kind, list(hashes)))

    def hashes(self, kind: str) -> list[bytes]:
        return [h for k, hs in self.events if k == kind for h in hs]


@pytest.fixture
def events() -> EventLog:
    return EventLog()


@pytest.fixture
def disk_store(tmp_path, events) -> Callable[..., KvStore]:
    """``disk_store(ram_budget, disk_budget)``: a store over ``tmp_path/blocks``;
    call it again for a fresh instance over the same directory (a restart)."""

    def make(ram_budget: int, disk_budget: int) -> KvStore:
        return KvStore(ram_budget, tmp_path / "blocks", disk_budget, on_event=events)

    return make
