"""The three request paths: prefill on the decode worker, prefill -> decode, and a first token that ends it."""

from __future__ import annotations

from kvmesh.api.common.v1 import kv_pb2, sampling_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from tests.gateway.fakes import DECODE_TOKENS, FIRST_TOKEN, FakeMesh
from tests.gateway.helpers import PROMPT, collect, make_gateway, request, sample


async def test_local_prefill_goes_straight_to_decode_and_streams_every_message(model) -> None:
    mesh = FakeMesh()
    mesh.prefill_locally = True
    gateway = make_gateway(model, mesh)

    chunks = await collect(gateway, request(max_tokens=4))

    assert [list(c.token_ids) for c in chunks] == [[FIRST_TOKEN], *[[t] for t in DECODE_TOKENS]]
    assert [c.offset for c in chunks] == [0, 1, 2, 3]
    assert all(c.request_id == "rid-1" for c in chunks)
    assert chunks[0].text == f"<{FIRST_TOKEN}>"
    assert not any(c.HasField("final") for c in chunks[:-1])
    final = chunks[-1].final
    assert final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(PROMPT), 4)
    assert final.usage.cached_tokens == 32  # the decode worker's own reuse
    assert final.system_fingerprint.startswith("fp_")  # the decode worker's configuration, passed on
    assert final.decode_timings.total_ns == 3 and final.route_timings.total_ns == 1
    assert final.timings.total_ns >= final.timings.first_token_ns > 0

    assert mesh.prefills == []
    [(worker, decode)] = mesh.decodes
    assert worker == "d0" and decode.WhichOneof("prefill") == "local"
    assert list(decode.prompt_token_ids) == PROMPT and decode.cache_salt == b"tenant-a"
    [route] = mesh.routes
    assert list(route.tokens.token_ids) == PROMPT
    assert (route.cache_salt, route.max_new_tokens, list(route.exclude_worker_ids)) == (b"tenant-a", 4, [])
    assert sample(gateway, "kvmesh_gateway_generated_tokens_total") == 4
    assert sample(gateway, "kvmesh_gateway_requests_total", method="generate", outcome="ok") == 1


async def test_remote_prefill_hands_its_kv_to_decode_unchanged(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)

    chunks = await collect(gateway, request(max_tokens=4, temperature=0.0))

    [(pworker, prefill)] = mesh.prefills
    assert pworker == "p0"
    assert prefill.handoff_mode == kv_pb2.HANDOFF_MODE_PULL
    assert list(prefill.token_ids) == PROMPT and prefill.cache_salt == b"tenant-a"
    assert prefill.sampling.HasField("temperature") and prefill.sampling.max_tokens == 4
    [(dworker, decode)] = mesh.decodes
    assert dworker == "d0" and decode.WhichOneof("prefill") == "remote"
    assert decode.remote.first_token_id == FIRST_TOKEN
    assert decode.remote.handoff.lease_id == "lease-1"
    assert decode.remote.handoff.source_address == "p0:1"
    assert list(decode.remote.handoff.block_hashes) == [b"h" * 16]

    assert [t for c in chunks for t in c.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]
    final = chunks[-1].final
    assert final.usage.cached_tokens == 16  # what the prefill worker reused
    assert final.prefill_timings.total_ns == 2
    await gateway.wait_idle()
    assert mesh.leases == set() and mesh.released == []  # decode ACKed; nothing for the gateway to end


async def test_a_first_token_that_ends_the_request_finishes_at_prefill(model) -> None:
    mesh = FakeMesh()
    mesh.prefill_finish = sampling_pb2.FINISH_REASON_LENGTH
    gateway = make_gateway(model, mesh)

    [chunk] = await collect(gateway, request(max_tokens=1))

    assert list(chunk.token_ids) == [FIRST_TOKEN] and chunk.offset == 0
    assert chunk.text == model.tokenizer.decode([FIRST_TOKEN])
    assert chunk.final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert (chunk.final.usage.completion_tokens, chunk.final.usage.cached_tokens) == (1, 16)
    assert mesh.decodes == [] and mesh.released == []


async def test_a_first_token_that_hits_a_stop_string_is_cut_there(model) -> None:
    mesh = FakeMesh()
    mesh.prefill_finish = sampling_pb2.FINISH_REASON_STOP
    gateway = make_gateway(model, mesh)
    stop = model.tokenizer.decode([FIRST_TOKEN])

    [chunk] = await collect(gateway, request(stop=[stop]))

    assert chunk.text == "" and list(chunk.token_ids) == [FIRST_TOKEN]


async def test_the_first_tokens_logprob_is_passed_on(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    real_prefill = mesh.prefill

    async def prefill_with_logprob(address: str, req: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        response = await real_prefill(address, req)
        response.first_token_logprob.token_id = FIRST_TOKEN
        response.first_token_logprob.logprob = -0.5
        return response

    mesh.prefill = prefill_with_logprob
    await collect(gateway, request(logprobs=True))

    [(_, decode)] = mesh.decodes
    assert decode.remote.first_token_logprob.logprob == -0.5


async def test_text_prompts_are_tokenized_with_special_tokens(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)

    await collect(gateway, request("def main():\n    return 0\n"))

    expected = model.tokenizer.encode("def main():\n    return 0\n", add_special_tokens=True)
    assert list(mesh.routes[0].tokens.token_ids) == expected
