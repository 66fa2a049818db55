"""64 concurrent streaming chats: every one completes with the right usage, and the mesh is left as it was."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from kvmesh.engine.tokenizer import Tokenizer
from tests.e2e.mesh_helpers import metrics
from tests.openai.conftest import MODEL

pytestmark = pytest.mark.timeout(600)

CONCURRENCY = 64
OUTPUT_TOKENS = 16


def _idle(mesh) -> tuple[float, float, float]:
    return (
        metrics(mesh, "gateway")["kvmesh_gateway_inflight_requests"],
        metrics(mesh, "decode-0")["kvmesh_engine_kv_blocks_in_use"],
        metrics(mesh, "prefill-0")["kvmesh_prefill_active_leases"],
    )


async def test_64_concurrent_streaming_chats(mesh, aclient, openai_model) -> None:
    tokenizer = Tokenizer(openai_model)
    conversations = [
        [{"role": "user", "content": f"Request {i}: write function number {i * 7919}."}] for i in range(CONCURRENCY)
    ]
    baseline = _idle(mesh)

    async def chat(messages: list[dict]) -> tuple[str, object, float]:
        start = time.perf_counter()
        first = None
        text, usage = "", None
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=OUTPUT_TOKENS,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                first = first if first is not None else time.perf_counter() - start
                text += choice.delta.content or ""
        return text, usage, first

    started = time.perf_counter()
    results = await asyncio.gather(*(chat(m) for m in conversations))
    wall = time.perf_counter() - started

    for messages, (_, usage, _) in zip(conversations, results):
        prompt = len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, OUTPUT_TOKENS)
        assert usage.total_tokens == prompt + OUTPUT_TOKENS
    for _ in range(100):
        if _idle(mesh) == baseline:
            break
        await asyncio.sleep(0.1)
    assert _idle(mesh) == baseline  # no request in flight, decode's KV back where it was, no lease held

    ttft = sorted(first for _, _, first in results)
    print(
        f"\nload: {CONCURRENCY} concurrent streaming chats x {OUTPUT_TOKENS} tokens in {wall:.2f} s: "
        f"{CONCURRENCY / wall:.1f} req/s, {CONCURRENCY * OUTPUT_TOKENS / wall:.0f} output tok/s, "
        f"TTFT p50 {statistics.median(ttft):.2f} s, p90 {ttft[int(0.9 * len(ttft))]:.2f} s"
    )
