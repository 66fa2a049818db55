"""Structured outputs and tool calls on the shipped model (models/pycode-small), through its own
mesh of real processes: the grammar holds whatever model is behind it, trained or random."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from kvmesh.launcher.supervisor import Mesh
from tests.e2e.mesh_helpers import http_url, start_mesh
from tests.openai.test_structured import ASK, json_schema
from tests.openai.test_tools import BOTH_TOOLS, valid_calls
from tests.openai.test_tools import SCHEMAS as BOTH_SCHEMAS
from tests.structured.schemas import SCHEMAS

pytestmark = pytest.mark.timeout(300)

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "pycode-small"
MODEL = SHIPPED.name


@pytest.fixture(scope="module")
def shipped_url(tmp_path_factory) -> Iterator[str]:
    blocks = {"KVMESH_NUM_BLOCKS": "256"}
    mesh: Mesh = start_mesh(
        SHIPPED, tmp_path_factory.mktemp("shipped-mesh"), role_env={"prefill": blocks, "decode": blocks}
    )
    try:
        yield http_url(mesh) + "/v1"
    finally:
        mesh.stop()


@pytest.fixture
async def shipped_client(shipped_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    # Per test: an async client belongs to the event loop of the test that made it.
    async with openai.AsyncOpenAI(base_url=shipped_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


async def test_every_json_schema_reply_validates(shipped_client) -> None:
    async def ask(i: int, name: str, schema: dict, temperature: float):
        return await shipped_client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format=json_schema(name, schema),
            max_tokens=200,
            temperature=temperature,
            seed=i,
        )

    # Greedy, and sampled: each grammar walked down more than one path.
    runs = [(i, name, schema, t) for t in (0.0, 1.0) for i, (name, schema) in enumerate(SCHEMAS)]
    replies = await asyncio.gather(*(ask(*run) for run in runs))
    for (_, name, schema, _), reply in zip(runs, replies):
        [choice] = reply.choices
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


async def test_tool_choice_required_always_yields_valid_calls(shipped_client) -> None:
    async def ask(seed: int, stream: bool, temperature: float = 1.0):
        kwargs = dict(
            model=MODEL,
            messages=ASK,
            tools=BOTH_TOOLS,
            tool_choice="required",
            max_tokens=120,
            temperature=temperature,
            seed=seed,
        )
        if not stream:
            return (await shipped_client.chat.completions.create(**kwargs)).choices[0]
        chunks = [c async for c in await shipped_client.chat.completions.create(**kwargs, stream=True)]
        return [c.choices[0] for c in chunks if c.choices]

    seeds = range(6)
    for choice in await asyncio.gather(*(ask(s, stream=False) for s in seeds)):
        assert choice.finish_reason == "tool_calls"
        assert valid_calls(choice.message, BOTH_TOOLS)
    for pieces in await asyncio.gather(*(ask(s, stream=True) for s in seeds)):
        assert pieces[-1].finish_reason == "tool_calls"
        calls = [t for p in pieces for t in p.delta.tool_calls or ()]
        assert calls and all(t.function.name in ("weather", "clock") for t in calls)
        for t in calls:
            jsonschema.validate(json.loads(t.function.arguments), BOTH_SCHEMAS[t.function.name])

    # Streamed deltas add up to the whole reply. One request at a time, greedy: this bf16 model's
    # logits move with the batch they are computed in, so only identical batches give identical text.
    whole = await ask(0, stream=False, temperature=0.0)
    pieces = await ask(0, stream=True, temperature=0.0)
    calls = [t for p in pieces for t in p.delta.tool_calls or ()]
    assert [(t.function.name, t.function.arguments) for t in calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
