"""response_format through a mesh of real processes (random weights), with the official openai client:
every reply is JSON that validates, streamed replies equal whole ones, bad schemas are 400s."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.openai.conftest import MODEL
from tests.structured.schemas import SCHEMAS

pytestmark = pytest.mark.timeout(300)

ASK = [{"role": "user", "content": "Reply with JSON."}]
MAX_TOKENS = 200
STREAMED = ("nested_objects", "array_of_objects", "string_pattern", "any_of")


def json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def test_every_json_schema_reply_validates(aclient) -> None:
    # Sampled (seeded) rather than greedy, so that each grammar is walked down more than one path.
    replies = await asyncio.gather(*(
        aclient.chat.completions.create(model=MODEL, messages=ASK, response_format=json_schema(name, schema),
                                        max_tokens=MAX_TOKENS, temperature=1.0, seed=i)
        for i, (name, schema) in enumerate(SCHEMAS)
    ))  # fmt: skip

    for (name, schema), reply in zip(SCHEMAS, replies):
        [choice] = reply.choices
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


async def test_json_object_replies_are_objects(aclient) -> None:
    replies = await asyncio.gather(*(
        aclient.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                        max_tokens=MAX_TOKENS, temperature=1.0, seed=i)
        for i in range(4)
    ))  # fmt: skip

    for reply in replies:
        if reply.choices[0].finish_reason == "stop":  # an object may nest past max_tokens: it has no bound
            assert isinstance(json.loads(reply.choices[0].message.content), dict)


async def test_a_streamed_reply_equals_the_whole_one(aclient) -> None:
    async def both(name: str, schema: dict) -> tuple[str, str]:
        kwargs = dict(
            model=MODEL, messages=ASK, response_format=json_schema(name, schema), max_tokens=MAX_TOKENS, temperature=0
        )
        whole = await aclient.chat.completions.create(**kwargs)
        chunks = [c async for c in await aclient.chat.completions.create(**kwargs, stream=True)]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        return whole.choices[0].message.content, streamed

    picked = [(name, schema) for name, schema in SCHEMAS if name in STREAMED]
    for whole, streamed in await asyncio.gather(*(both(name, schema) for name, schema in picked)):
        assert streamed == whole


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (json_schema("x", {"type": "array", "uniqueItems": True}), "keyword 'uniqueItems' is not supported"),
        (json_schema("x", {"type": "string", "format": "iri"}), "format 'iri' is not supported"),
        (json_schema("x", {"type": "object", "required": "name"}), "not a valid JSON Schema"),
        (json_schema("x", {"$ref": "https://example.com/schema.json"}), "only local references"),
    ],
)
def test_a_schema_the_grammar_cannot_enforce_is_400_saying_why(client, response_format, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, max_tokens=4)

    error = info.value.response.json()["error"]
    assert error["param"] == "response_format" and message in error["message"]
