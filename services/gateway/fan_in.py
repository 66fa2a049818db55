"""Several of the core's response streams read at once, as one stream of ``(index, chunk)``.

One OpenAI request with ``n`` choices or several prompts is several requests
through the mesh. Each is read by its own task, under its own request id (for
logs and the mesh), into one queue. The first error from any of them is the
whole request's error; closing the fan-in (normally, on error, or because the
HTTP handler was cancelled when its client hung up) cancels every task, which
closes every core stream, which cancels the downstream calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.runtime import request_id_scope

Chunk = gateway_pb2.GenerateResponse | gateway_pb2.ChatResponse
Stream = AsyncGenerator[Chunk, None]
Event = tuple[int, Chunk]

_ENDED = object()


class FanIn:
    def __init__(self, streams: Sequence[tuple[str, Stream]]) -> None:
        """``streams``: (request id, stream) pairs; chunks come back tagged with the pair's index."""
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._open = len(streams)
        self._tasks = [asyncio.create_task(self._read(i, rid, s)) for i, (rid, s) in enumerate(streams)]

    async def _read(self, index: int, request_id: str, stream: Stream) -> None:
        with request_id_scope(request_id):
            try:
                async with aclosing(stream):
                    async for chunk in stream:
                        self._queue.put_nowait((index, chunk))
            except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
                self._queue.put_nowait((index, e))
                return
        self._queue.put_nowait((index, _ENDED))

    async def next(self) -> Event | None:
        """The next chunk of any stream; None once all have ended. Raises the first error of any."""
        while self._open:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _ENDED:
                self._open -= 1
                continue
            return index, item
        return None

    async def first_of_each(self) -> list[Event]:
        """Wait until every stream has sent its first chunk (or ended): by then each was admitted,
        routed and started, so what could be refused has been. Returns the chunks read meanwhile."""
        read: list[Event] = []
        waiting = set(range(len(self._tasks)))
        while waiting:
            event = await self.next()
            if event is None:
                break
            read.append(event)
            waiting.discard(event[0])
        return read

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> FanIn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
