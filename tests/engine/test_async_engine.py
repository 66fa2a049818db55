"""The engine thread: concurrent streams, errors to the caller, cancellation frees blocks."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams

from .conftest import PROMPTS


@pytest.fixture
def aengine(checkpoints):
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64, enable_prefix_cache=False))
    ae = AsyncEngine(engine)
    ae.start()
    yield ae
    ae.stop()


async def _collect(ae, prompt, rid, n=16):
    toks = []
    async for out in ae.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), rid):
        toks += out.new_token_ids
    return toks


async def test_concurrent_streams_match_the_synchronous_engine(aengine, checkpoints):
    got = await asyncio.gather(*(_collect(aengine, p, f"r{i}") for i, p in enumerate(PROMPTS)))
    sync = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))
    expected = [
        c.token_ids for c in sync.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    ]
    assert got == expected


async def test_bad_request_raises_in_the_caller(aengine):
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        await _collect(aengine, [], "bad")
    assert await _collect(aengine, [1, 2, 3], "after", n=2)  # the loop is still alive


async def test_cancelled_stream_aborts_and_frees_blocks(aengine):
    stream = aengine.generate(
        list(range(1, 60)), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), "long"
    )
    await stream.__anext__()
    assert await aengine.call(lambda e: e.blocks.num_free) < 64
    await stream.aclose()
    assert await aengine.call(lambda e: (e.blocks.num_free, e.has_unfinished())) == (64, False)


async def test_task_cancellation_aborts_too(aengine):
    task = asyncio.create_task(_collect(aengine, list(range(1, 60)), "cancel-me", n=400))
    while await aengine.call(lambda e: e.num_running) == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if await aengine.call(lambda e: e.blocks.num_free) == 64:
            break
        await asyncio.sleep(0.01)
    assert await aengine.call(lambda e: e.blocks.num_free) == 64


async def test_started_builds_the_engine_on_its_step_loop_thread(checkpoints):
    """Only that thread runs torch ops: a second OpenMP team (the loader's) would throttle every step."""
    import threading

    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread())
        return LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))

    ae = await AsyncEngine.started(build)
    try:
        assert built_on == [ae._thread] and ae._thread is not threading.main_thread()
        assert await _collect(ae, PROMPTS[0], "r") == (
            LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))
            .generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
            .token_ids
        )
    finally:
        ae.stop()


async def test_a_build_that_fails_raises_from_started(tmp_path):
    with pytest.raises(InvalidArgument, match="is not a directory"):
        await AsyncEngine.started(lambda: LLMEngine(tmp_path / "missing"))
