"""The demo service (``demo_service.py``) as a real process, and its JSON log lines as they come."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


async def spawn_demo(*argv: str, env: Mapping[str, str]) -> asyncio.subprocess.Process:
    """``python -m tests.runtime.demo_service *argv`` with exactly ``env``; its stderr (the logs) piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.runtime.demo_service",
        *argv,
        cwd=REPO,
        env=dict(env),
        stderr=asyncio.subprocess.PIPE,
    )


async def log_until(stream: asyncio.StreamReader, event: str) -> list[dict]:
    """The log lines up to and including the first of ``event`` (the process ending first fails)."""
    seen = []
    while True:
        line = await asyncio.wait_for(stream.readline(), timeout=30)
        assert line, f"process ended before logging {event!r}"
        seen.append(json.loads(line))
        if seen[-1]["event"] == event:
            return seen
