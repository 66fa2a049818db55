"""/openapi.json is a valid OpenAPI 3.1 document, and what the server sends matches it."""

from __future__ import annotations

import aiohttp
import jsonschema
import pytest
from openapi_spec_validator import validate

from services.gateway.auth import ApiKeys
from services.gateway.openapi import Served, openapi_document
from tests.gateway.fakes import FakeMesh
from tests.gateway.helpers import PROMPT
from tests.gateway.test_http_api import http_gateway


@pytest.mark.parametrize("auth", [False, True])
def test_the_document_is_valid_openapi(auth) -> None:
    validate(openapi_document(Served("tiny", 300, 256, 8), auth=auth))


def test_the_openai_and_anthropic_schemas_keep_their_own_names() -> None:
    # Two models of one name would both be renamed after their modules ("services__gateway__...").
    schemas = openapi_document(Served("tiny", 300, 256, 8), auth=False)["components"]["schemas"]
    assert {"UserMessage", "AssistantMessage", "UserTurn", "AssistantTurn", "MessagesRequest"} <= set(schemas)
    assert not [name for name in schemas if "__" in name]


def _check(document: dict, path: str, method: str, status: int, body: object) -> None:
    schema = document["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]
    # The schemas refer to #/components/...: validate with the whole document as the root.
    root = {**document, **schema}
    jsonschema.Draft202012Validator(root).validate(body)


async def test_responses_match_the_document(model) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 20}], "max_tokens": 4}
    message = chat | {"system": "Be brief."}
    async with (
        http_gateway(model, FakeMesh(), keys=ApiKeys(["k"])) as served,
        aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as http,
    ):

        async def call(method: str, path: str, body: object = None) -> tuple[int, object]:
            async with http.request(method, served.url + path, json=body) as r:
                return r.status, await r.json()

        document = (await call("GET", "/openapi.json"))[1]
        cases = [
            ("post", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2}),
            ("post", "/v1/chat/completions", chat),
            ("post", "/v1/chat/completions", chat | {"temperature": 9}),
            ("post", "/v1/chat/completions", chat | {"model": "gpt-9"}),
            ("post", "/v1/messages", message),
            ("post", "/v1/messages", message | {"thinking": {"type": "enabled"}}),
            ("post", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4}),
            ("post", "/v1/responses", {"model": "tiny", "input": "hi", "previous_response_id": "resp_unknown"}),
            ("get", "/v1/responses/{response_id}", None),
            ("post", "/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
            ("post", "/detokenize", {"model": "tiny", "tokens": [10**9]}),
            ("get", "/v1/models", None),
            ("get", "/v1/models/{model}", None),
            ("get", "/health", None),
        ]
        seen = []
        for method, path, body in cases:
            status, answer = await call(
                method.upper(), path.replace("{model}", "tiny").replace("{response_id}", "resp_unknown"), body
            )
            _check(document, path, method, status, answer)
            seen.append(status)
        async with aiohttp.ClientSession() as anonymous:
            async with anonymous.get(served.url + "/v1/models") as r:
                _check(document, "/v1/models", "get", r.status, await r.json())
                seen.append(r.status)

    assert seen == [200, 200, 400, 404, 200, 400, 200, 404, 404, 200, 400, 200, 200, 200, 401]
