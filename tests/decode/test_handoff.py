"""Prefill -> decode hand-off through the real services in-process (no router)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvmesh.api.common.v1 import kv_pb2, sampling_pb2
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from kvmesh.worker.kv_nixl import load_nixl
from services.decode import main as decode_main
from services.prefill import main as prefill_main
from tests.engine.conftest import write_checkpoint
from tests.service_helpers import serve_main

pytestmark = pytest.mark.slow

BS = 16
PROMPT = list(range(30, 30 + 3 * BS + 7))  # three full blocks and a partial one
N_NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama-gqa")


@pytest.fixture(scope="module")
def expected(model):
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    return engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[0].token_ids


def greedy(n=N_NEW, **kw):
    return sampling_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(params=["grpc", "nixl"])
async def services(model, request):
    if request.param == "nixl" and load_nixl() is None:
        pytest.skip("NIXL is not installed (scripts/install.sh installs it)")
    """Both KV transports run every hand-off test (on NIXL, both agents share this process)."""
    engine_args = ["--model", str(model), "--num-blocks", "64", "--kv-transport", request.param]
    async with (
        serve_main("prefill", prefill_main, [*engine_args, "--lease-ttl-ms", "1500"]) as p,
        serve_main("decode", decode_main, engine_args) as d,
    ):
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{p.port}") as pc,
            grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as dc,
        ):
            yield p, d, prefill_pb2_grpc.PrefillServiceStub(pc), decode_pb2_grpc.DecodeServiceStub(dc)


async def _decode(stub, request):
    tokens, final = [], None
    async for msg in stub.Decode(request):
        assert msg.offset == len(tokens)
        tokens += msg.token_ids
        if msg.HasField("final"):
            final = msg.final
    return tokens, final


async def test_remote_prefill_then_decode_matches_colocated_engine(services, expected):
    p, d, prefill, decode = services
    pre = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r1", token_ids=PROMPT, sampling=greedy()))
    assert pre.first_token_id == expected[0]
    assert pre.handoff.mode == kv_pb2.HANDOFF_MODE_PULL and len(pre.handoff.block_hashes) == 3
    on_nixl = p.servicer_of("kvmesh.api.prefill.v1.PrefillService").worker.nixl is not None
    assert pre.handoff.HasField("nixl") == on_nixl
    assert pre.computed_tokens == len(PROMPT)
    remote = decode_pb2.RemotePrefill(first_token_id=pre.first_token_id, handoff=pre.handoff)
    tokens, final = await _decode(
        decode, decode_pb2.DecodeRequest(request_id="r1", prompt_token_ids=PROMPT, sampling=greedy(), remote=remote)
    )
    assert tokens == expected
    assert final.usage.completion_tokens == N_NEW and final.usage.cached_tokens == 3 * BS
    assert final.timings.transfer_ns > 0
    # Decode computed only the partial block + first token, then one per step.
    dec_engine = d.servicer_of("kvmesh.api.decode.v1.DecodeService").worker.engine.engine
    assert dec_engine.stats.imported_blocks == 3
    assert dec_engine.stats.computed_tokens == (len(PROMPT) - 3 * BS + 1) + (N_NEW - 2)
    # The lease was acknowledged and nothing stays pinned on prefill.
    pre_worker = p.servicer_of("kvmesh.api.prefill.v1.PrefillService").worker
    # The ack goes out as the stream ends (shielded, beside the last message): give it a moment to land.
    for _ in range(100):
        if len(pre_worker.leases) == 0:
            break
        await asyncio.sleep(0.05)
    assert len(pre_worker.leases) == 0 and pre_worker.counters.leases_acked == 1
    # On NIXL the bytes never went through PullKV.
    assert pre_worker.counters.blocks_sent == (0 if on_nixl else 3)
    pre_engine = pre_worker.engine.engine
    assert pre_engine.blocks.num_free == 64
    # A second prompt sharing the prefix computes only the new blocks on prefill.
    again = await prefill.Prefill(
        prefill_pb2.PrefillRequest(request_id="r2", token_ids=PROMPT[: 3 * BS] + [5] * 20, sampling=greedy())
    )
    assert again.reused_tokens == 3 * BS and again.computed_tokens == 20
    await prefill.ReleaseLease(prefill_pb2.ReleaseLeaseRequest(lease_id=again.handoff.lease_id))


@pytest.mark.parametrize("services", ["nixl"], indirect=True)
async def test_a_block_that_fails_its_checksum_after_a_nixl_read_is_refused(services, expected):
    p, d, prefill, decode = services
    pre = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r", token_ids=PROMPT, sampling=greedy()))
    # One bit of the second block flipped in prefill's pool after its checksum went out.
    pool = p.servicer_of("kvmesh.api.prefill.v1.PrefillService").worker.engine.engine.kv.tensor
    pool[0, 0, pre.handoff.nixl.block_ids[1]].view(torch.uint8)[0, 0, 0] ^= 1
    remote = decode_pb2.RemotePrefill(first_token_id=pre.first_token_id, handoff=pre.handoff)
    tokens, _ = await _decode(
        decode, decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=PROMPT, sampling=greedy(), remote=remote)
    )
    assert tokens == expected  # recomputed on decode
    worker = d.servicer_of("kvmesh.api.decode.v1.DecodeService").worker
    assert worker.counters.transfer_failures == 1
    # None of the READ's blocks was adopted, and every reserved one went back to the pool.
    assert await worker.engine.call(lambda e: (e.stats.imported_blocks, e.blocks.num_free)) == (0, 64)


async def test_unreleased_lease_expires_and_unpins(services):
    p, _, prefill, _ = services
    pre = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r", token_ids=PROMPT, sampling=greedy()))
    worker = p.servicer_of("kvmesh.api.prefill.v1.PrefillService").worker
    assert len(worker.leases) == 1 and worker.engine.engine.blocks.num_free < 64
    for _ in range(60):
        if len(worker.leases) == 0:
            break
        await asyncio.sleep(0.1)
    assert worker.counters.leases_expired == 1
    assert await worker.engine.call(lambda e: e.blocks.num_free) == 64
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in prefill.PullKV(prefill_pb2.PullKVRequest(lease_id=pre.handoff.lease_id)):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_dead_prefill_peer_falls_back_to_local_compute(services, expected):
    _, d, _, decode = services
    handoff = kv_pb2.KVHandoff(
        mode=kv_pb2.HANDOFF_MODE_PULL, source_address="127.0.0.1:1", lease_id="gone", block_hashes=[b"x" * 16]
    )
    remote = decode_pb2.RemotePrefill(first_token_id=expected[0], handoff=handoff)
    tokens, final = await _decode(
        decode, decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=PROMPT, sampling=greedy(), remote=remote)
    )
    assert tokens == expected
    assert d.servicer_of("kvmesh.api.decode.v1.DecodeService").worker.counters.transfer_failures == 1


async def test_local_prefill_on_decode_and_first_token_finish(services, expected):
    _, d, prefill, decode = services
    tokens, final = await _decode(
        decode, decode_pb2.DecodeRequest(request_id="l", prompt_token_ids=PROMPT, sampling=greedy(), local={})
    )
    assert tokens == expected and final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    one = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="one", token_ids=PROMPT, sampling=greedy(1)))
    assert one.finish_reason == sampling_pb2.FINISH_REASON_LENGTH and one.handoff.mode == kv_pb2.HANDOFF_MODE_NONE


async def test_cancelled_decode_frees_its_blocks(services):
    _, d, _, decode = services
    call = decode.Decode(
        decode_pb2.DecodeRequest(request_id="c", prompt_token_ids=PROMPT, sampling=greedy(400), local={})
    )
    await call.read()
    engine = d.servicer_of("kvmesh.api.decode.v1.DecodeService").worker.engine
    assert await engine.call(lambda e: e.num_running) == 1
    call.cancel()
    for _ in range(50):
        if await engine.call(lambda e: (e.num_running, e.blocks.num_free)) == (0, 64):
            break
        await asyncio.sleep(0.05)
    assert await engine.call(lambda e: (e.num_running, e.blocks.num_free)) == (0, 64)


async def test_bad_sampling_is_invalid_argument(services):
    _, _, prefill, _ = services
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill.Prefill(
            prefill_pb2.PrefillRequest(
                request_id="b", token_ids=PROMPT, sampling=sampling_pb2.SamplingParams(top_p=2.0)
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "mistral", "qwen3-moe", "deepseek-v3"])
async def test_each_family_hands_off_what_it_computes_colocated(tmp_path, arch):
    """The families with layers of their own (Gemma 3, Qwen3-MoE's experts, DeepSeek-V3's latent attention and
    its latent blocks), fused checkpoint tensors (Phi-3) and sliding windows shorter than the prompt (the first
    three) through the split path: prefill's blocks, pulled over gRPC, decode on as the colocated engine does."""
    await _split_path_gives_colocated_tokens(write_checkpoint(tmp_path / arch, arch), [], [])


async def _split_path_gives_colocated_tokens(
    model, prefill_flags: list[str], decode_flags: list[str], transport: str = "grpc"
) -> None:
    """PROMPT prefilled by a prefill worker (``prefill_flags``), its blocks moved over ``transport`` to a decode
    worker (``decode_flags``): the tokens the colocated engine gives."""
    colocated = LLMEngine(model, EngineConfig(num_blocks=64))
    want = colocated.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[0]
    args = ["--model", str(model), "--num-blocks", "64", "--kv-transport", transport]
    async with (
        serve_main("prefill", prefill_main, args + prefill_flags) as p,
        serve_main("decode", decode_main, args + decode_flags) as d,
    ):
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{p.port}") as pc,
            grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as dc,
        ):
            prefill, decode = prefill_pb2_grpc.PrefillServiceStub(pc), decode_pb2_grpc.DecodeServiceStub(dc)
            pre = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="f", token_ids=PROMPT, sampling=greedy()))
            assert pre.handoff.HasField("nixl") == (transport == "nixl")
            remote = decode_pb2.RemotePrefill(first_token_id=pre.first_token_id, handoff=pre.handoff)
            request = decode_pb2.DecodeRequest(
                request_id="f", prompt_token_ids=PROMPT, sampling=greedy(), remote=remote
            )
            tokens, final = await _decode(decode, request)
    assert tokens == want.token_ids and final.usage.cached_tokens == 3 * BS


EP2 = ["--tensor-parallel-size", "2", "--enable-expert-parallel"]
TP2 = ["--tensor-parallel-size", "2"]


@pytest.mark.skipif(load_nixl() is None, reason="NIXL is not installed (scripts/install.sh installs it)")
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"),
    [([], []), pytest.param([], TP2, marks=pytest.mark.slow), pytest.param(TP2, [], marks=pytest.mark.slow)],
    ids=["tp1-to-tp1", "tp1-to-tp2", "tp2-to-tp1"],
)
async def test_latent_blocks_move_over_nixl(tmp_path, prefill_tp, decode_tp):
    """DeepSeek-V3's one-plane latent pool, READ over NIXL block by block (the planes a block has are the
    pool's); at TP2 every rank holds the whole latent, so any degree reads from any."""
    model = write_checkpoint(tmp_path / "mla", "deepseek-v3")
    await _split_path_gives_colocated_tokens(model, prefill_tp, decode_tp, "nixl")


@pytest.mark.slow  # starts a rank process
@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize(("prefill_ep", "decode_ep"), [([], EP2), (EP2, [])], ids=["ep1-to-ep2", "ep2-to-ep1"])
async def test_a_moe_model_hands_off_between_expert_parallel_degrees(tmp_path, arch, prefill_ep, decode_ep):
    """Prefill and decode with their experts split differently (one rank holding all, two holding half each):
    the KV (a dense model's, or DeepSeek-V3's latent, whole on every rank) crosses unchanged over gRPC and
    decode goes on as the colocated engine does."""
    await _split_path_gives_colocated_tokens(write_checkpoint(tmp_path / arch, arch), prefill_ep, decode_ep)
