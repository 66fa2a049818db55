"""The whole mesh as real processes with a real Redis: faithful, disaggregated, cancellable."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from tests.e2e.mesh_helpers import BLOCK, metrics

pytestmark = pytest.mark.timeout(300)


def greedy(n: int) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def generate(gateway, ids: list[int], n: int) -> tuple[list[int], gateway_pb2.StreamEnd]:
    tokens, final = [], None
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), sampling=greedy(n))
    async for msg in gateway.Generate(request):
        assert msg.offset == len(tokens)
        tokens += msg.token_ids
        if msg.HasField("final"):
            final = msg.final
    return tokens, final


def local_greedy(model, prompts, n):
    engine = LLMEngine(model, EngineConfig(num_blocks=128))
    return [
        c.token_ids for c in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    ]


async def test_greedy_through_the_mesh_equals_the_in_process_engine(mesh, gateway, e2e_model):
    prompts = [list(range(40, 40 + 37)), [7, 8, 9], list(range(200, 200 + 2 * BLOCK))]
    got = await asyncio.gather(*(generate(gateway, p, 24) for p in prompts))
    assert [t for t, _ in got] == local_greedy(e2e_model, prompts, 24)
    for (_, final), prompt in zip(got, prompts):
        assert final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert final.usage.prompt_tokens == len(prompt) and final.usage.completion_tokens == 24


async def test_prefill_computes_decode_imports_and_a_shared_prefix_is_reused(mesh, gateway):
    prompt = list(range(300, 300 + 3 * BLOCK + 5))
    p0, d0 = metrics(mesh, "prefill-0"), metrics(mesh, "decode-0")
    await generate(gateway, prompt, 4)
    p1, d1 = metrics(mesh, "prefill-0"), metrics(mesh, "decode-0")
    assert p1["kvmesh_prefill_computed_tokens_total"] - p0["kvmesh_prefill_computed_tokens_total"] == len(prompt)
    assert d1["kvmesh_engine_imported_blocks_total"] - d0["kvmesh_engine_imported_blocks_total"] == 3
    # Decode recomputed only the partial block and the first token, then one token per step.
    assert d1["kvmesh_engine_computed_tokens_total"] - d0["kvmesh_engine_computed_tokens_total"] == 5 + 1 + 2

    second = prompt[: 3 * BLOCK] + [9] * 10
    _, final = await generate(gateway, second, 2)
    p2 = metrics(mesh, "prefill-0")
    assert p2["kvmesh_prefill_reused_tokens_total"] - p1["kvmesh_prefill_reused_tokens_total"] == 3 * BLOCK
    assert p2["kvmesh_prefill_computed_tokens_total"] - p1["kvmesh_prefill_computed_tokens_total"] == 10
    assert final.usage.cached_tokens == 3 * BLOCK


async def test_speculation_keeps_output_identical_and_accepts_drafts(mesh, gateway, e2e_model):
    # Repetitive traffic: the speculator's shared suffix index learns the first completion,
    # so the same request again is drafted from it (a random model's own text rarely repeats).
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 3
    expected = local_greedy(e2e_model, [prompt], 32)[0]
    first, _ = await generate(gateway, prompt, 32)
    before = metrics(mesh, "decode-0")["kvmesh_engine_draft_tokens_accepted_total"]
    second, _ = await generate(gateway, prompt, 32)
    assert first == second == expected
    assert metrics(mesh, "decode-0")["kvmesh_engine_draft_tokens_accepted_total"] > before


async def test_client_cancel_frees_the_requests_blocks_on_decode(mesh, gateway):
    """Cancelled after its first token, a request stops on decode and leaves nothing held anywhere.

    Nothing here reads a state the request passes through (blocks held mid-stream): with speculation a
    tiny model's 400 tokens once finished before the scrape that looked for them. What the cancel did
    is read from counters after it: the request reached decode, and it stopped short of its length."""
    before = metrics(mesh, "decode-0")
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=list(range(1, 40))), sampling=greedy(460))
    call = gateway.Generate(request)
    await call.read()
    call.cancel()
    for _ in range(100):
        d, g = metrics(mesh, "decode-0"), metrics(mesh, "gateway")
        if d["kvmesh_engine_kv_blocks_in_use"] == 0 and g["kvmesh_gateway_inflight_requests"] == 0:
            break
        await asyncio.sleep(0.1)
    assert d["kvmesh_engine_kv_blocks_in_use"] == 0
    assert d["kvmesh_engine_running_sequences"] == 0
    assert g["kvmesh_gateway_inflight_requests"] == 0
    assert metrics(mesh, "prefill-0")["kvmesh_prefill_active_leases"] == 0
    assert d["kvmesh_engine_prompt_tokens_total"] > before["kvmesh_engine_prompt_tokens_total"]  # it ran on decode
    assert d["kvmesh_engine_generated_tokens_total"] - before["kvmesh_engine_generated_tokens_total"] < 460


async def test_blocks_written_to_the_kvstore_are_fetched_instead_of_recomputed(mesh, gateway):
    """The cluster-wide tier: a prefix the prefill worker lost is fetched from the kvstore."""
    prompt = list(range(100, 100 + 4 * BLOCK + 3))
    await generate(gateway, prompt, 2)
    for _ in range(50):  # written behind the request
        if metrics(mesh, "kvstore")["kvmesh_kvstore_blocks{tier=ram}"] >= 4:
            break
        await asyncio.sleep(0.1)
    # Drop the prefill worker's own copy: other prompts take its whole pool (128 blocks).
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        await generate(gateway, torch.randint(1, 500, (30 * BLOCK,), generator=g).tolist(), 1)
    before = metrics(mesh, "prefill-0")
    _, final = await generate(gateway, prompt[: 4 * BLOCK] + [5, 6], 2)
    after = metrics(mesh, "prefill-0")
    fetched = (
        after["kvmesh_prefill_kvstore_fetched_blocks_total"] - before["kvmesh_prefill_kvstore_fetched_blocks_total"]
    )
    assert fetched > 0
    assert final.usage.cached_tokens >= fetched * BLOCK
