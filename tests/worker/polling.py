"""Waiting for something another task or thread makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait for ``condition``; the timeout bounds a hang, it is not a timing assertion."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
