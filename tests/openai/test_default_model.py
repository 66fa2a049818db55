"""The real default model (SmolLM2-135M-Instruct) through the whole mesh, over HTTP with the official client.

- Fidelity: greedy tokens identical to transformers (float32, the same converted folder)
  for the 8 reference prompts x 64 tokens, top-5 logprobs within 1e-3; a divergence
  only on a near-tie the reference shows.
- The README's two examples, with the gateway's default settings: `def fibonacci(n):`
  completes to Python that parses (cut at the last complete line), and the capital of
  France is Paris.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator, Iterator

import openai
import pytest

from kvmesh.engine.default_model import default_model_path
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.launcher.supervisor import Mesh
from tests.e2e.mesh_helpers import http_url, start_mesh
from tests.models.smollm2_reference import LOGPROB_TOLERANCE, NEW_TOKENS, TOP, first_divergence, references

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def default_url(tmp_path_factory) -> Iterator[str]:
    # float32 workers (the reference's precision) and the gateway's own defaults otherwise.
    workers = {"KVMESH_NUM_BLOCKS": "256", "KVMESH_DTYPE": "float32"}
    mesh: Mesh = start_mesh(
        default_model_path(), tmp_path_factory.mktemp("default-mesh"), role_env={"prefill": workers, "decode": workers}
    )
    try:
        yield http_url(mesh) + "/v1"
    finally:
        mesh.stop()


@pytest.fixture
async def client(default_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=default_url, api_key="unused", max_retries=0, timeout=600) as c:
        yield c


async def test_greedy_output_through_the_mesh_matches_transformers(client) -> None:
    tok = Tokenizer(default_model_path())
    refs = references()

    async def ask(prompt: list[int]):
        return await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=TOP,
            extra_body={"ignore_eos": True},
        )

    replies = await asyncio.gather(*(ask(r.prompt_ids) for r in refs))
    diverged = 0
    for ref, reply in zip(refs, replies):
        [choice] = reply.choices
        got_texts = choice.logprobs.tokens
        want_texts = [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
        # Token texts stand for ids here (the HTTP API speaks text); equal texts at every step = same tokens.
        got_ids = [t if g == w else -1 for t, g, w in zip(ref.token_ids, got_texts, want_texts)]
        end = first_divergence(ref, got_ids + [-1] * (len(ref.steps) - len(got_ids)))
        diverged += end is not None
        for step, chosen, top in list(zip(ref.steps, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))[
            :end
        ]:
            want = {tok.decode([i], skip_special_tokens=False): v for i, v in step.top}
            assert abs(chosen - step.top[0][1]) < LOGPROB_TOLERANCE
            shared = [t for t in top if t in want]
            # Texts stand in for ids: byte tokens that are part of one character all read "\ufffd".
            assert len(shared) >= min(len(top), len(want)) - 1, (top, want)
            assert all(abs(top[t] - want[t]) < LOGPROB_TOLERANCE for t in shared), (top, want)
        if end is None:
            assert reply.usage.completion_tokens == NEW_TOKENS and reply.usage.prompt_tokens == len(ref.prompt_ids)
    assert diverged <= 2


async def test_readme_fibonacci_completes_to_python_that_parses(client) -> None:
    reply = await client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=64, temperature=0)
    text = "def fibonacci(n):" + reply.choices[0].text
    complete = text[: text.rindex("\n")] if "\n" in text else text
    ast.parse(complete)
    assert "return" in complete


async def test_readme_chat_knows_the_capital_of_france(client) -> None:
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=64,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
