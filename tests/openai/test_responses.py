"""POST /v1/responses through a mesh of real processes (random weights), with the official openai client.

Greedy replies are compared with chat completions of the same messages; what the weights write is
otherwise unknown, so calls and JSON are checked against their schemas (the grammar makes them valid).
The gateway keeps stored responses in the mesh's Redis (the launcher passes the gateway its URL).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import redis

from tests.openai.conftest import MODEL

pytestmark = pytest.mark.timeout(300)

INSTRUCTIONS = "You write Python."
ASK = "Write a loop."
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}]
MAX_TOKENS = 12
# The call is about 60 characters (its only arguments are {"zone": "UTC"}: nothing else to wander
# into), and the tokenizer is nearly character-level on JSON: room for it (a call cut short is no call).
CALL_TOKENS = 100
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
NOW = {"type": "function", "name": "now", "description": "The time.", "parameters": ZONE}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def test_a_response_is_the_chat_completion_of_the_same_messages(client) -> None:
    response = client.responses.create(
        model=MODEL, input=ASK, instructions=INSTRUCTIONS, max_output_tokens=MAX_TOKENS, temperature=0
    )
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)

    [choice] = chat.choices
    assert response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == choice.message.content
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )


def test_a_streamed_response_equals_the_whole_one(client) -> None:
    request = {"model": MODEL, "input": ASK, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))

    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    last = events[-1]
    assert last.type == {"completed": "response.completed", "incomplete": "response.incomplete"}[whole.status]
    assert last.response.output_text == whole.output_text
    usage = last.response.usage  # cached tokens differ: the stream's prompt was the whole one's
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)


def test_a_required_function_call_and_its_output(client) -> None:
    first = client.responses.create(
        model=MODEL,
        input="What time is it?",
        tools=[NOW],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=CALL_TOKENS,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1, first.model_dump_json()
    [call] = calls
    assert call.name == "now" and json.loads(call.arguments) == {"zone": "UTC"} and first.status == "completed"

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    second = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "What time is it?"}, *first.output, answer],
        tools=[NOW],
        max_output_tokens=8,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.output
    # The call and its output are in the second prompt: it is the first one and then some.
    assert second.usage.input_tokens > first.usage.input_tokens + 5


def test_a_json_schema_format_gives_json_that_validates(client) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Reply with JSON.",
        text={"format": {"type": "json_schema", "name": "flag", "schema": FLAG, "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), FLAG)
    assert response.text.format.type == "json_schema"


def test_a_follow_up_continues_the_stored_conversation_from_cache(client) -> None:
    first = client.responses.create(
        model=MODEL, input="Cache check " + "lorem ipsum dolor " * 10, max_output_tokens=4, temperature=0
    )
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )

    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The first prompt's full blocks (16 tokens) at least came from cache.
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens - 1) // 16 * 16 > 0
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_stored_responses_are_in_the_meshs_redis(client, mesh) -> None:
    env = mesh.topology.get("gateway").env
    password_file = env.get("KVMESH_REDIS_PASSWORD_FILE")
    password = Path(password_file).read_text().strip() if password_file else None
    store = redis.Redis.from_url(env["KVMESH_REDIS_URL"], password=password)
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    try:
        assert len(store.keys(f"kvmesh:responses:*:{response.id}")) == 1
        client.responses.delete(response.id)
        assert store.keys(f"kvmesh:responses:*:{response.id}") == []
    finally:
        store.close()
