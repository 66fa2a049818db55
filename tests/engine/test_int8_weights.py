"""``--quantization int8`` on CPU: the engine serves exactly what an ``int8-channel`` checkpoint's
dequantized weights give (the weights the fidelity report measures), eagerly, compiled, batched
and while verifying drafts; and it gets a fingerprint of its own."""

from __future__ import annotations

import pytest
import torch

from kvmesh.checkpoint.compressed import write_checkpoint
from kvmesh.checkpoint.files import iter_tensors, weight_files
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter

from .conftest import PROMPTS
from .test_speculative import ScriptedProposer

pytestmark = pytest.mark.slow

N_NEW = 40  # crosses block boundaries (block size 16)


def _int8_checkpoint(src, out):
    """Every projection of ``src`` in the int8-channel format (the LM head stays, as the engine's int8 does)."""
    names = [n for n, _ in iter_tensors(weight_files(src))]
    return write_checkpoint(src, out, {n.rsplit(".", 1)[0]: "int8-channel" for n in names if "_proj.weight" in n})


def _greedy(engine: LLMEngine, prompts) -> list[list[int]]:
    return [
        r.token_ids
        for r in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
    ]


@pytest.mark.native_cpu
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias", "qwen3-qknorm-tied"])
def test_int8_serves_what_the_int8_channel_checkpoint_does(checkpoints, tmp_path, arch):
    src = checkpoints[arch]
    dequantized = LLMEngine(_int8_checkpoint(src, tmp_path / "q"), EngineConfig(num_blocks=64))
    int8 = LLMEngine(src, EngineConfig(num_blocks=64, quantization="int8"))
    assert _greedy(int8, [PROMPTS[0]]) == _greedy(dequantized, [PROMPTS[0]])
    assert _greedy(int8, PROMPTS) == _greedy(dequantized, PROMPTS)
    assert int8.fingerprint != LLMEngine(src, EngineConfig(num_blocks=64)).fingerprint


@pytest.mark.native_cpu
def test_compiled_int8_decodes_as_eager_and_never_recompiles(checkpoints):
    from torch._dynamo.utils import counters

    path = checkpoints["llama-gqa"]
    eager = LLMEngine(path, EngineConfig(num_blocks=128, quantization="int8"))
    compiled = LLMEngine(path, EngineConfig(num_blocks=128, quantization="int8", compile=True))
    graphs = counters["stats"]["unique_graphs"]
    assert _greedy(compiled, [PROMPTS[0]]) == _greedy(eager, [PROMPTS[0]])
    assert _greedy(compiled, PROMPTS) == _greedy(eager, PROMPTS)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.native_cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_verify_steps_keep_greedy_output(checkpoints, dtype):
    """A verify multiplies k + 1 rows a sequence; the int8 kernel gives each row what it gets
    alone, so drafts (right ones, then wrong ones) change no token, in bf16 too."""
    path = checkpoints["llama-gqa"]
    plain = _greedy(LLMEngine(path, EngineConfig(num_blocks=64, dtype=dtype, quantization="int8")), [PROMPTS[0]])[0]
    cfg = EngineConfig(num_blocks=64, dtype=dtype, quantization="int8")
    oracle = ScriptedProposer({"r": plain[:20]})  # right for 20 tokens, then no drafts
    drafting = LLMEngine(path, cfg, drafter=Drafter(oracle, 3, ()))
    drafting.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True), request_id="r")
    tokens = []
    while drafting.has_unfinished():
        tokens += [t for o in drafting.step() for t in o.new_token_ids]
    assert tokens == plain
    assert drafting.stats.draft_tokens_accepted >= 15
    garbage = LLMEngine(path, cfg, drafter=Drafter(ScriptedProposer(garbage=True), 3, ()))
    assert _greedy(garbage, [PROMPTS[0]])[0] == plain
    assert garbage.stats.draft_tokens_proposed > garbage.stats.draft_tokens_accepted


@pytest.mark.native_cpu
def test_an_int8_lm_head_serves_what_the_checkpoint_with_an_int8_head_does(checkpoints, tmp_path):
    src = checkpoints["llama-gqa"]  # untied: the plan's lm_head is the head alone
    names = [n.rsplit(".", 1)[0] for n, _ in iter_tensors(weight_files(src)) if n.endswith(".weight")]
    plan = {n: "int8-channel" for n in names if n.endswith("_proj") or n == "lm_head"}
    dequantized = LLMEngine(write_checkpoint(src, tmp_path / "q", plan), EngineConfig(num_blocks=64))
    int8 = LLMEngine(src, EngineConfig(num_blocks=64, quantization="int8", quantize_lm_head=True))
    assert _greedy(int8, PROMPTS) == _greedy(dequantized, PROMPTS)
    without_head = LLMEngine(src, EngineConfig(num_blocks=64, quantization="int8"))
    assert int8.fingerprint != without_head.fingerprint


@pytest.mark.native_cpu
def test_a_tied_int8_head_keeps_the_embedding_lookup_and_the_speculation_path(checkpoints):
    from kernels.quantized_linear import QuantizedLinear
    from kvmesh.checkpoint.formats import fake_quantize, get_format

    path = checkpoints["qwen3-qknorm-tied"]
    plain = LLMEngine(path, EngineConfig(num_blocks=64))
    cfg = EngineConfig(num_blocks=64, quantization="int8", quantize_lm_head=True)
    int8 = LLMEngine(path, cfg, drafter=Drafter(ScriptedProposer(garbage=True), 2))
    head = int8.model.head_proj
    assert isinstance(head, QuantizedLinear)  # the small-row linears (speculation) left it in place
    embedding = plain.model.embed_tokens.weight
    assert torch.equal(int8.model.embed_tokens.weight, embedding)
    stored = {"weight": head.qweight, "weight_scale": head.scale[:, None]}
    assert torch.equal(get_format("int8-channel").dequantize(stored), fake_quantize("int8-channel", embedding.float()))
    assert _greedy(int8, [PROMPTS[0]]) == _greedy(
        LLMEngine(path, EngineConfig(num_blocks=64, quantization="int8", quantize_lm_head=True)), [PROMPTS[0]]
    )


def test_an_lm_head_alone_is_not_quantized(checkpoints):
    with pytest.raises(InvalidArgument, match="quantize_lm_head needs a quantization"):
        LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=16, quantize_lm_head=True))
