"""The compiled decode step (``EngineConfig(compile=True)``) against transformers and eager.

Compilation is slow (seconds per graph), so one engine per architecture family is
compiled here: a GQA llama and a qk-norm, tied-embedding Qwen3.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter

from .conftest import PROMPTS
from .hf_reference import hf_greedy

pytestmark = pytest.mark.slow

N_NEW = 40  # crosses block boundaries (block size 16), so block tables widen mid-decode


# Mistral: Llama's layers with a sliding window, which the graphs must keep; Gemma 3: its own layers, two rope
# tables, QK-norm, a tied and soft-capped head (the other tests here run llama-gqa).
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_compiled_decode_matches_transformers_and_never_recompiles(checkpoints, arch):
    from torch._dynamo.utils import counters

    path = checkpoints[arch]
    engine = LLMEngine(path, EngineConfig(num_blocks=128, compile=True))
    graphs = counters["stats"]["unique_graphs"]
    # One alone, then all at once: decode batches of 1 and many, block tables of 2..4 blocks.
    alone = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[
        0
    ].token_ids
    batched = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
    assert alone == hf_greedy(path, PROMPTS[0], N_NEW)[0]
    for prompt, res in zip(PROMPTS, batched):
        assert res.token_ids == hf_greedy(path, prompt, N_NEW)[0], f"{arch}: prompt {prompt[:4]}..."
    # The warm-up built every graph a decode step needs: serving compiled nothing more.
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_decode_with_speculation_matches_transformers(checkpoints):
    """Verify steps (laid out as decodes) and decode steps through the compiled graphs: the
    first request's drafts (wrong ones) run out after 12 tokens, and from there both requests
    decode."""
    from .test_speculative import ScriptedProposer

    path = checkpoints["llama-gqa"]
    drafts = ScriptedProposer({"req-0": [7, 8, 9] * 4})
    engine = LLMEngine(path, EngineConfig(num_blocks=128, compile=True), drafter=Drafter(drafts, 3, ()))
    got = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, got):
        assert res.token_ids == hf_greedy(path, prompt, N_NEW)[0]
    assert engine.stats.draft_tokens_proposed > 0


def test_compiled_steps_write_every_layers_kv(checkpoints):
    """Each layer's K/V lands in its own layer of the pool, as the eager step writes it."""
    path = checkpoints["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    pools = []
    for compiled in (False, True):
        engine = LLMEngine(path, EngineConfig(num_blocks=32, enable_prefix_cache=False, compile=compiled))
        engine.kv.tensor.zero_()  # the warm-up's scratch KV must not matter either way
        engine.generate([PROMPTS[1]], params)
        pools.append(engine.kv.tensor.clone())
    eager, compiled = pools
    assert eager.abs().sum() > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_two_compiled_engines_of_one_architecture_keep_their_own_weights(checkpoints, tmp_path):
    """Each engine's graphs see only its own model. The graphs skip dynamo's guards on the
    model's modules and the batched one bakes the weights in: a graph looked up for the wrong
    model (same shapes) would answer with the other model's weights."""
    from .conftest import write_checkpoint

    paths = [checkpoints["llama-gqa"], write_checkpoint(tmp_path / "other", "llama-gqa", seed=1)]
    engines = [LLMEngine(path, EngineConfig(num_blocks=64, compile=True)) for path in paths]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for path, engine in zip(paths, engines):
        for prompts in ([PROMPTS[0]], PROMPTS[:3]):  # the one-sequence graph, then the batched one
            for prompt, res in zip(prompts, engine.generate(prompts, params)):
                assert res.token_ids == hf_greedy(path, prompt, 12)[0], f"{path.name}: prompt {prompt[:4]}..."


def test_a_compiled_bfloat16_engine_alone_decodes_as_eager(checkpoints):
    """bf16 builds the one-sequence graph with freezing too (weights prepacked for AMX): one
    sequence decodes what the eager engine does, until bf16 rounding (fused ops round differently)
    parts them on this random model, after 10 tokens; and warm-up built every graph it needs."""
    from torch._dynamo.utils import counters

    path = checkpoints["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    eager = LLMEngine(path, EngineConfig(num_blocks=128, dtype="bfloat16")).generate([PROMPTS[0]], params)
    engine = LLMEngine(path, EngineConfig(num_blocks=128, dtype="bfloat16", compile=True))
    graphs = counters["stats"]["unique_graphs"]
    assert engine.generate([PROMPTS[0]], params)[0].token_ids[:8] == eager[0].token_ids[:8]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.native_cpu
@pytest.mark.parametrize(("floor", "streamed"), [(1, 0), (4, 0), (1, 1), (4, 6)])
def test_float32_one_sequence_graph_runs_the_one_row_product_calibration_chose(
    checkpoints, monkeypatch, floor, streamed
):
    """Inductor packs a float32 weight for oneDNN only where a graph's row count is symbolic; a
    static row goes to MKL. Where the small-row linears stream one row (kernels.cpu's
    streamed_mm), the one-sequence graph keeps its row static and calls that; where they run it
    on oneDNN (a floor of 1), the graph keeps its rows symbolic and every product in it is
    oneDNN's; otherwise it keeps the plain products. (The calibrations' verdicts are fixed
    here.) Every way it decodes what transformers does."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from kernels import small_rows_linear

    monkeypatch.setattr(small_rows_linear, "fewest_rows_that_pay", lambda *_, **__: floor)
    monkeypatch.setattr(small_rows_linear, "most_rows_that_stream", lambda *_, **__: streamed)
    path = checkpoints["llama-gqa"]
    torch._dynamo.reset()  # so that this engine's graphs are compiled here, where their code is kept
    engine, codes = run_and_get_code(lambda: LLMEngine(path, EngineConfig(num_blocks=128, compile=True)))
    alone_code = codes[0]  # the warm-up compiles the one-sequence graph first
    assert ("streamed_mm" in alone_code) == (streamed >= 1)
    assert ("_linear_pointwise" in alone_code) == (floor == 1 and streamed == 0)
    assert "mkl_linear" not in alone_code
    graphs = counters["stats"]["unique_graphs"]
    alone = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[
        0
    ].token_ids
    assert alone == hf_greedy(path, PROMPTS[0], N_NEW)[0]
    assert counters["stats"]["unique_graphs"] == graphs  # serving's unmarked rows run the warm-up's graph


@pytest.mark.native_cpu
def test_verify_steps_run_a_graph_of_few_rows_on_streamed_products(checkpoints, monkeypatch):
    """Where the small-row linears stream up to 6 rows, the warm-up builds a graph for 2 to 6
    rows whose products call streamed_mm, between the one-row graph and the batched one (which
    does not stream). The start-up draft-cost probe times those graphs, compiling none of its
    own; verifies of up to 3 drafts run there, decode what transformers does, and compile
    nothing more."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from kernels import small_rows_linear

    from .test_speculative import ScriptedProposer

    monkeypatch.setattr(small_rows_linear, "most_rows_that_stream", lambda *_, **__: 6)
    path = checkpoints["llama-gqa"]
    expected = hf_greedy(path, PROMPTS[0], N_NEW)[0]
    drafts = ScriptedProposer({"req-0": expected})
    torch._dynamo.reset()  # so that this engine's graphs are compiled here, where their code is kept
    engine, codes = run_and_get_code(
        lambda: LLMEngine(path, EngineConfig(num_blocks=128, compile=True), drafter=Drafter(drafts, 3, ()))
    )
    assert engine.model.compiled_decode.few_rows == 6
    assert len(codes) == 3
    alone, few, batched = codes
    assert "streamed_mm" in alone and "streamed_mm" in few and "streamed_mm" not in batched
    graphs = counters["stats"]["unique_graphs"]
    got = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[0]
    assert got.token_ids == expected
    assert engine.stats.draft_tokens_accepted == engine.stats.draft_tokens_proposed > 0
    # A 3-token prompt alone: its prefill (one sampling row of three) stays eager, on the extend layout.
    short = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert short.token_ids == hf_greedy(path, PROMPTS[1], 8)[0]
    assert counters["stats"]["unique_graphs"] == graphs
