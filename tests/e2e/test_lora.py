"""LoRA adapters across the mesh (the shared one: mutual TLS, speculation on): loaded at run time over the
HTTP admin API on every worker, three adapters and the base model in one batch through prefill, the KV
hand-off and decode match transformers + PEFT, their prefixes are cached apart, and unloading, reloading
and refusing a broken adapter leave other streams alone."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import aiohttp
import pytest
from safetensors.torch import load_file, save_file

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from tests.e2e.mesh_helpers import http_url
from tests.engine.peft_reference import ADAPTERS, peft_greedy, write_peft_adapter

pytestmark = pytest.mark.timeout(300)

N_NEW = 32
# 40 tokens (2 full blocks) each, of their own: the mesh is shared, and a prefix another test sends
# must not be found cached.
PROMPTS = [random.Random(f"e2e-lora-{i}").choices(range(50, 500), k=40) for i in range(5)]


@pytest.fixture(scope="module")
def adapter_dirs(e2e_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-lora")
    return {
        name: write_peft_adapter(e2e_model, root / name, seed, **settings)
        for seed, (name, settings) in enumerate(ADAPTERS.items())
    }


async def _admin(mesh, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(http_url(mesh) + path, json=body) as r:
        return r.status, await r.json()


async def _generate(
    gateway, prompt: list[int], model: str = "", max_tokens: int = N_NEW, started: asyncio.Event | None = None
) -> tuple[list[int], int]:
    sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(model=model, token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling)
    tokens, cached = [], -1
    async for msg in gateway.Generate(request):
        tokens += msg.token_ids
        if started is not None:
            started.set()
        if msg.HasField("final"):
            cached = msg.final.usage.cached_tokens
    return tokens, cached


@pytest.fixture
async def loaded(mesh, adapter_dirs):
    for name, path in adapter_dirs.items():
        status, body = await _admin(mesh, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert status == 200, body
    yield adapter_dirs
    for name in adapter_dirs:  # leave the shared mesh as it was
        await _admin(mesh, "/v1/unload_lora_adapter", {"lora_name": name})


async def test_adapters_and_the_base_in_one_batch_match_peft(mesh, gateway, e2e_model, loaded):
    async with aiohttp.ClientSession() as http, http.get(http_url(mesh) + "/v1/models") as r:
        listed = {m["id"]: m.get("parent") for m in (await r.json())["data"]}
    assert {name: listed.get(name) for name in loaded} == dict.fromkeys(loaded, e2e_model.name)
    models = [*loaded, ""]
    got = await asyncio.gather(*(_generate(gateway, p, m) for p, m in zip(PROMPTS, models)))
    for (tokens, _), prompt, model in zip(got, PROMPTS, models):
        expected, _ = peft_greedy(e2e_model, loaded.get(model), prompt, N_NEW)
        assert tokens == expected, f"model {model or 'base'}"


async def test_one_prompt_under_two_adapters_shares_no_cached_blocks(gateway, loaded):
    prompt = PROMPTS[4] + PROMPTS[4][:10]  # 3 full blocks
    _, first = await _generate(gateway, prompt, "qv", max_tokens=2)
    _, other = await _generate(gateway, prompt, "all-rslora", max_tokens=2)
    _, base = await _generate(gateway, prompt, "", max_tokens=2)
    _, again = await _generate(gateway, prompt, "qv", max_tokens=2)
    assert (first, other, base) == (0, 0, 0)
    assert again == 48  # its own blocks: every full block but the one holding the last token's


async def test_unload_reload_and_a_broken_adapter_while_streams_run(mesh, gateway, adapter_dirs, tmp_path):
    path = adapter_dirs["qv"]
    status, _ = await _admin(mesh, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(path)})
    assert status == 200
    started = asyncio.Event()
    long = 440  # as long as the tiny model's context allows: the streams must outlast the calls below
    base_stream = asyncio.ensure_future(_generate(gateway, PROMPTS[0], "", max_tokens=long))
    live_stream = asyncio.ensure_future(_generate(gateway, PROMPTS[1], "live", max_tokens=long, started=started))
    await started.wait()
    status, body = await _admin(mesh, "/v1/unload_lora_adapter", {"lora_name": "live"})
    assert status == 400 and "serves 1 request" in body["error"]["message"], body

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = tensors[key][:, :3].contiguous()  # rank 3 against lora_A's 8
    save_file(tensors, broken / "adapter_model.safetensors")
    status, body = await _admin(mesh, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)})
    assert status == 400 and "do not fit" in body["error"]["message"], body
    status, body = await _admin(mesh, "/v1/load_lora_adapter", {"lora_name": "nothing", "lora_path": str(tmp_path)})
    assert status == 400 and "not a PEFT adapter folder" in body["error"]["message"], body

    (base_tokens, _), (live_tokens, _) = await asyncio.gather(base_stream, live_stream)
    assert len(base_tokens) == len(live_tokens) == long
    status, _ = await _admin(mesh, "/v1/unload_lora_adapter", {"lora_name": "live"})
    assert status == 200
    with pytest.raises(Exception, match="model 'live' is not served"):
        await _generate(gateway, PROMPTS[1], "live")
    status, _ = await _admin(mesh, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(path)})
    assert status == 200
    assert (await _generate(gateway, PROMPTS[1], "live", max_tokens=long))[0] == live_tokens
    assert (await _admin(mesh, "/v1/unload_lora_adapter", {"lora_name": "live"}))[0] == 200
    assert json.dumps(body)  # the last refusal's body was JSON (OpenAI's error shape)


def test_kvmesh_verify_checks_a_served_adapter_against_peft(mesh, adapter_dirs, e2e_model, capsys):
    from kvmesh.cli import main

    path = adapter_dirs["all-rslora"]
    status, _ = asyncio.run(_admin(mesh, "/v1/load_lora_adapter", {"lora_name": "v", "lora_path": str(path)}))
    assert status == 200
    try:
        flags = ["verify", "--endpoint", http_url(mesh) + "/v1", "--model", str(e2e_model), "--served-model", "v"]
        rc = main([*flags, "--lora", str(path), "--min-agreement", "1.0"])
        out = capsys.readouterr().out
        assert rc == 0 and "6/6 identical" in out and "+ PEFT adapter" in out, out
        # Against another adapter's files, the served one is caught.
        assert main([*flags, "--lora", str(adapter_dirs["qv"]), "--min-agreement", "1.0"]) == 1
        assert "FAIL: greedy agreement" in capsys.readouterr().out
    finally:
        asyncio.run(_admin(mesh, "/v1/unload_lora_adapter", {"lora_name": "v"}))
