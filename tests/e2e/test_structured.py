"""Constrained decoding across the mesh: prefill samples the first token under the grammar,
decode continues it, and speculation (on in this mesh) changes nothing in the output."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from kvmesh.structured.spec import GrammarSpec
from tests.e2e.mesh_helpers import metrics
from tests.structured.schemas import SCHEMAS

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 160
PICKED = [s for name, s in SCHEMAS if name in ("nested_objects", "array_of_objects", "refs_and_defs", "uuid_format")]
OTHERS = [GrammarSpec("regex", r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"), GrammarSpec("any_json")]
SPECS = [GrammarSpec.json_schema(s) for s in PICKED] + OTHERS


async def _generate(gateway, prompt: list[int], spec: GrammarSpec) -> tuple[list[int], str, int]:
    sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_output=spec.to_pb())
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling)
    tokens, text, finish = [], [], 0
    async for msg in gateway.Generate(request):
        tokens += msg.token_ids
        text.append(msg.text)
        if msg.HasField("final"):
            finish = msg.final.finish_reason
    return tokens, "".join(text), finish


async def test_constrained_output_with_speculation_equals_the_engine_without(mesh, gateway, e2e_model):
    prompt = list(range(60, 90))
    engine = LLMEngine(e2e_model, EngineConfig(num_blocks=256))
    expected = [c.token_ids for c in engine.generate(
        [prompt] * len(SPECS), [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=g) for g in SPECS]
    )]  # fmt: skip
    before = metrics(mesh, "decode-0")["kvmesh_engine_draft_tokens_accepted_total"]
    # Twice: the speculator learns the first answers and drafts the second ones from them.
    for _ in range(2):
        got = await asyncio.gather(*(_generate(gateway, prompt, g) for g in SPECS))
        assert [tokens for tokens, _, _ in got] == expected
    after = metrics(mesh, "decode-0")
    assert after["kvmesh_engine_draft_tokens_accepted_total"] > before
    assert after["kvmesh_engine_grammar_compiles_total"] >= len(SPECS)
    for (_, text, finish), spec in zip(got, SPECS):
        assert finish == sampling_pb2.FINISH_REASON_STOP, text
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(text), json.loads(spec.source))
        elif spec.kind == "regex":
            assert re.fullmatch(spec.source, text)
        else:
            json.loads(text)


async def test_an_unenforceable_schema_is_invalid_argument_saying_why(gateway):
    spec = GrammarSpec.json_schema({"type": "array", "uniqueItems": True})
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _generate(gateway, [1, 2, 3], spec)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keyword 'uniqueItems' is not supported" in e.value.details()


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}


async def test_grpc_chat_with_a_required_tool_streams_one_valid_call(gateway):
    request = gateway_pb2.ChatRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=150),
        tools=[gateway_pb2.Tool(name="weather", parameters_json=json.dumps(WEATHER))],
        tool_choice=gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED),
        parallel_tool_calls=False,
    )
    calls, text, final = [], [], None
    async for msg in gateway.Chat(request):
        calls += msg.tool_calls
        text.append(msg.text)
        if msg.HasField("final"):
            final = msg.final
    assert final.finish_reason == sampling_pb2.FINISH_REASON_TOOL_CALLS
    assert "".join(text).strip() == ""  # calls only: no markup leaks into the text
    [call] = calls
    assert call.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
