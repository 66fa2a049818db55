"""Keeps the shared suffix index up to date off the request path.

Indexing a finished 4k-token sequence takes milliseconds; done inline, it
would delay every draft queued behind it past its decode step's budget. So
the service learns with ``defer_indexing`` and this task does the work in
small chunks, yielding to the event loop between them.
"""

from __future__ import annotations

import asyncio

import structlog

from kvmesh.speculation.speculator import Speculator

log = structlog.get_logger(__name__)

# Small enough a chunk that indexing it never holds the event loop long (docs/measurements.md).
CHUNK_TOKENS = 1024


class IndexMaintainer:
    def __init__(self, speculator: Speculator, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self._spec = speculator
        self._chunk = chunk_tokens
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="speculator-index-maintenance")

    def wake(self) -> None:
        """Something was learned: index it soon."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while self._spec.maintain_index(self._chunk):
                    await asyncio.sleep(0)
            except Exception:  # a bug here must not end learning for the life of the process
                log.exception("suffix index maintenance failed")
