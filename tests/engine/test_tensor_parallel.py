"""Tensor parallelism in one engine (``EngineConfig(tensor_parallel_size=N)``): rank 0 in this process,
the other ranks its children, all-reduces through shared memory (or a gloo process group). Greedy tokens
as TP1 and transformers give them, logprobs within 1e-4, with KV heads split and with fewer KV heads than
ranks (replicated); speculation and structured outputs across ranks; compiled decode steps on every rank;
configurations that cannot be split refused by name; a rank killed fails the step instead of hanging it."""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import replace

import pytest
import torch

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.checksum import checksum
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.tensor_parallel import RankLost
from kvmesh.engine.tp_layout import TPLayout
from kvmesh.errors import FailedPrecondition, InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter
from kvmesh.structured.spec import GrammarSpec

from .conftest import PROMPTS
from .hf_reference import hf_greedy
from .test_speculative import ScriptedProposer

NEW_TOKENS = 32
EIGHT_PROMPTS = [*PROMPTS, *([(5 * i + k) % 500 + 1 for i in range(9 + 7 * k)] for k in range(4))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def _engine(path, size: int, **kwargs) -> LLMEngine:
    drafter = kwargs.pop("drafter", None)
    return LLMEngine(path, EngineConfig(num_blocks=128, tensor_parallel_size=size, **kwargs), drafter=drafter)


def _close_enough(a, b) -> None:
    """Same tokens; every logprob and top-5 alternative within 1e-4 (the ranks' sums round differently)."""
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        for p, q in zip(x.logprobs, y.logprobs):
            assert abs(p.logprob - q.logprob) < 1e-4
            assert [t for t, _ in p.top] == [t for t, _ in q.top]
            assert max(abs(v - w) for (_, v), (_, w) in zip(p.top, q.top)) < 1e-4


def test_the_layout_splits_heads_and_columns_and_refuses_what_does_not_divide(checkpoints) -> None:
    mc = ModelConfig.from_dir(checkpoints["llama-gqa"])  # 4 heads, 2 KV heads of 16, intermediate 128
    second = TPLayout.of(mc, 1, 2)
    assert (second.local_heads, second.local_kv_heads, second.kv_replicated) == (2, 1, False)
    q = torch.arange(64 * 64).view(64, 64)
    assert torch.equal(second.shard("model.layers.0.self_attn.q_proj.weight", q), q[32:64])
    assert torch.equal(second.shard("model.layers.0.self_attn.k_proj.weight", q[:32]), q[16:32])
    assert torch.equal(second.shard("model.layers.0.self_attn.o_proj.weight", q), q[:, 32:64])
    assert second.shard("model.norm.weight", q) is q
    # Four ranks over 2 KV heads: ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    assert [TPLayout.of(mc, r, 4)._range("kv") for r in range(4)] == [(0, 16), (0, 16), (16, 16), (16, 16)]
    with pytest.raises(InvalidArgument, match="tensor parallelism of 3 cannot split LlamaForCausalLM: 4 attention"):
        TPLayout.of(mc, 0, 3)


def test_the_lm_head_splits_by_vocabulary_rows() -> None:
    layouts = [TPLayout(r, 3, 6, 3, 8, 12) for r in range(3)]
    assert [t.vocab_range(100) for t in layouts] == [(0, 34), (34, 34), (68, 32)]
    assert [t.vocab_range(2) for t in layouts] == [(0, 1), (1, 1), (2, 0)]  # a rank may have none


def test_each_rank_looks_up_its_vocabulary_rows_and_the_sum_is_the_whole_embedding(checkpoints) -> None:
    """Four ranks over a 9-token vocabulary (3, 3, 3 and 0 rows): each rank's lookup holds its own tokens'
    rows and zeros elsewhere, so the all-reduce's sum is one whole table's lookup, bit for bit."""
    from kvmesh.engine.model import CausalLM

    mc = replace(ModelConfig.from_dir(checkpoints["llama-mha-tied"]), vocab_size=9)
    whole = torch.randn(9, mc.hidden_size)
    ids = torch.tensor([0, 8, 3, 3, 5, 2, 6])
    parts = []
    for rank in range(4):
        layout = TPLayout(rank, 4, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size)
        model = CausalLM(mc, torch.float32, torch.device("cpu"), 64, layout, all_reduce=lambda t: None)
        first, count = model.head_rows
        assert model.embed_tokens.weight.shape[0] == count == (3 if rank < 3 else 0)
        model.embed_tokens.weight.data.copy_(whole[first : first + count])
        parts.append(model.embed(ids))
    assert torch.equal(sum(parts), whole[ids])


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3", "qwen2-bias", "llama-mha-tied"])
def test_two_ranks_give_one_rank_s_greedy_tokens_and_logprobs(checkpoints, arch) -> None:
    """llama-gqa: 2 KV heads, one a rank; llama3-rope: 1 KV head, replicated; qwen2-bias: q/k/v biases
    split with their rows; llama-mha-tied: the tied LM head. Every rank holds half the vocabulary's embedding
    and head rows and computes their logits (rank 0 of the first half only: the tokens would not match if the
    other half went missing); a draft head still reads the whole vocabulary's (``whole_vocab_weights``)."""
    path = checkpoints[arch]
    single = _engine(path, 1)
    one = single.generate(EIGHT_PROMPTS, GREEDY)
    two = _engine(path, 2)
    try:
        vocab = two.runner.model.cfg.vocab_size
        assert two.runner.model.head_rows == (0, vocab // 2)
        assert two.runner.model.head_proj.weight.shape[0] == vocab // 2  # the head's product reads its rows only
        assert two.runner.model.head_weight.shape[0] == two.runner.model.embed_tokens.weight.shape[0] == vocab // 2
        whole = single.runner.model
        for theirs, ours in zip(two.runner.model.whole_vocab_weights(), (whole.embed_tokens.weight, whole.head_weight)):
            assert torch.equal(theirs, ours)
        _close_enough(two.generate(EIGHT_PROMPTS, GREEDY), one)
    finally:
        two.close()
    if arch == "llama-gqa":
        for prompt, done in zip(EIGHT_PROMPTS[:2], one):
            assert hf_greedy(path, prompt, NEW_TOKENS)[0] == done.token_ids


def test_compiled_decode_steps_across_ranks(checkpoints) -> None:
    """``compile=True`` at TP2: each rank compiles its own decode graphs, with the all-reduce one op inside
    them (``kvmesh.engine.traced_all_reduce``: no graph break). One sequence, three and eight give one eager
    rank's tokens, logprobs within 1e-4, and serving compiles nothing more. A rank lost while rank 0 waits
    in a graph's all-reduce fails the step with RankLost, as in an eager step, not a RuntimeError."""
    from torch._dynamo.utils import counters

    path = checkpoints["llama-gqa"]
    single = _engine(path, 1)
    batches = [EIGHT_PROMPTS[:1], EIGHT_PROMPTS[:3], EIGHT_PROMPTS]  # the one-row, few-rows and batched graphs
    want = [single.generate(prompts, GREEDY) for prompts in batches]
    counters.clear()
    engine = _engine(path, 2, compile=True)
    try:
        assert engine.runner.model.compiled_decode is not None
        assert not counters["graph_break"]
        assert engine.runner.model.compiled_decode.eager_on_recompile  # a rank never compiles mid-step
        # Here rank 0 may, so that a step its graphs did not fit shows as a new graph, not as an eager step.
        engine.runner.model.compiled_decode.eager_on_recompile = False
        graphs = counters["stats"]["unique_graphs"]
        for prompts, one in zip(batches, want):
            _close_enough(engine.generate(prompts, GREEDY), one)
        assert counters["stats"]["unique_graphs"] == graphs
        engine.add_request(EIGHT_PROMPTS[0], GREEDY)
        engine.step()  # its prefill (eager)
        engine.step()  # a compiled decode
        (follower,) = engine.runner.tp._processes
        # Stopped, its pipe still takes the next step's inputs: rank 0 enters the graph and waits in its
        # first all-reduce until the follower is killed.
        follower.send_signal(signal.SIGSTOP)
        threading.Timer(1.0, follower.kill).start()
        with pytest.raises(RankLost, match="all-reduce failed"):
            engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("compiled", [False, True])
def test_speculative_verifies_across_ranks(checkpoints, compiled) -> None:
    """Verify steps run on every rank like any step: eager, and through the compiled graphs (laid out as
    decodes), with the drafter's calibration probes mirrored after the ranks compiled."""
    path = checkpoints["llama-gqa"]
    one = _engine(path, 1).generate(EIGHT_PROMPTS, GREEDY)
    spec = _engine(path, 2, drafter=Drafter(ScriptedProposer(garbage=True), 3, ()), compile=compiled)
    try:
        _close_enough(spec.generate(EIGHT_PROMPTS, GREEDY), one)
        assert spec.stats.draft_tokens_proposed > 0
    finally:
        spec.close()


def test_penalties_chunked_prefill_and_the_prefix_cache_across_ranks(checkpoints) -> None:
    """Rank 0 alone samples, schedules and keeps the block table; the other ranks run the same steps. Penalised
    sampling, prompts prefilled in 16-token chunks, and prompts that find their prefix cached give one rank's
    tokens and logprobs."""
    path = checkpoints["llama-gqa"]
    penalised = replace(GREEDY, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
    long = [(7 * i + 3) % 500 + 1 for i in range(70)]
    prompts = [
        long,
        [(11 * i + 5) % 500 + 1 for i in range(45)],
        long[:48] + [7, 8, 9],
    ]  # the third: 3 blocks of the first
    one, two = _engine(path, 1, max_num_batched_tokens=16), _engine(path, 2, max_num_batched_tokens=16)
    try:
        for params in (penalised, GREEDY):
            expected = one.generate(prompts, params)
            got = two.generate(prompts, params)  # the second round finds every prompt's full blocks cached
            _close_enough(got, expected)
        assert [c.num_cached_tokens for c in got] == [c.num_cached_tokens for c in expected]
        assert min(c.num_cached_tokens for c in got) >= 32
    finally:
        two.close()


def test_structured_output_across_ranks(llama_with_tokenizer) -> None:
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4}
    params = SamplingParams(temperature=0.0, max_tokens=64, grammar=GrammarSpec.json_schema(schema))
    engine = _engine(llama_with_tokenizer, 2)
    try:
        (done,) = engine.generate([engine.tokenizer.encode("[")], params)
    finally:
        engine.close()
    assert done.finish_reason == "stop" and isinstance(json.loads(done.text), list)


def test_what_ranks_cannot_serve_yet_is_refused_before_any_starts(checkpoints) -> None:
    with pytest.raises(InvalidArgument, match="cannot split"):
        _engine(checkpoints["llama-gqa"], 3)


def _int8_per_rank_reference(src, out, ranks: int, head: bool = False):
    """``src`` with every projection's weights replaced by what ``ranks`` ranks' int8 slices hold, dequantized:
    column-parallel rows whole, row-parallel (o_proj, down_proj) rows cut into ``ranks`` column slices, each
    slice quantized with a scale of its own; with ``head``, the LM head's rows too (a scale a row, so its
    vocabulary shards quantize as the whole does). One rank serving it is what those ranks serve with int8."""
    import shutil

    from safetensors.torch import save_file

    from kernels.quantized_linear import quantize_int8_weight
    from kvmesh.checkpoint.files import iter_tensors, weight_files

    def fake_quant(w: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_int8_weight(w)
        return (q.float() * scale[:, None]).to(w.dtype)

    tensors = {}
    for name, t in iter_tensors(weight_files(src)):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t = torch.cat([fake_quant(part) for part in t.chunk(ranks, dim=1)], dim=1)
        elif name.endswith("_proj.weight") or (head and name == "lm_head.weight"):
            t = fake_quant(t)
        tensors[name] = t.contiguous()
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.native_cpu
def test_quantized_checkpoints_and_int8_weights_across_ranks(checkpoints, tmp_path) -> None:
    """A compressed-tensors checkpoint (every rank dequantizes its slice) gives one rank's tokens and
    logprobs. ``--quantization int8``: each rank quantizes its own slice, so a row-parallel slice's rows
    get scales of their own (finer than one rank's, as other engines' per-shard scales are); two ranks
    serve exactly what one rank serves on those dequantized slices."""
    from .test_int8_weights import _int8_checkpoint

    src = checkpoints["llama-gqa"]
    checkpoint = _int8_checkpoint(src, tmp_path / "int8-channel")
    single = _engine(checkpoint, 1)
    one = single.generate(EIGHT_PROMPTS, GREEDY)
    per_rank = _engine(_int8_per_rank_reference(src, tmp_path / "per-rank", 2), 1).generate(EIGHT_PROMPTS, GREEDY)
    with_head = _int8_per_rank_reference(src, tmp_path / "per-rank-head", 2, head=True)
    per_rank_head = _engine(with_head, 1).generate(EIGHT_PROMPTS, GREEDY)
    engines = [
        _engine(checkpoint, 2),
        _engine(src, 2, quantization="int8"),
        _engine(src, 2, quantization="int8", quantize_lm_head=True),  # each rank its vocabulary rows' head
    ]
    try:
        # The whole vocabulary's weights a draft head reads: dequantized from the checkpoint as one rank loads them.
        whole = (single.runner.model.embed_tokens.weight, single.runner.model.head_weight)
        assert all(map(torch.equal, engines[0].runner.model.whole_vocab_weights(), whole))
        _close_enough(engines[0].generate(EIGHT_PROMPTS, GREEDY), one)
        _close_enough(engines[1].generate(EIGHT_PROMPTS, GREEDY), per_rank)
        _close_enough(engines[2].generate(EIGHT_PROMPTS, GREEDY), per_rank_head)
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("all_reduce", ["shm", "gloo"])
def test_a_rank_killed_fails_the_step_instead_of_hanging_it(checkpoints, all_reduce) -> None:
    engine = _engine(checkpoints["llama-gqa"], 2, tp_all_reduce=all_reduce)
    try:
        engine.generate(EIGHT_PROMPTS[:1], GREEDY)
        (follower,) = engine.runner.tp._processes
        follower.kill()
        follower.wait(10)
        with pytest.raises(RankLost, match="rank 1 is gone|all-reduce failed"):
            engine.generate(EIGHT_PROMPTS[:1], GREEDY)
    finally:
        engine.close()


@pytest.mark.native_cpu
def test_ranks_in_a_gloo_process_group_give_the_shared_memory_ranks_bits(checkpoints) -> None:
    """``--tp-all-reduce gloo``: the torch.distributed path CUDA ranks take with NCCL, here between CPU processes.
    Two float32 partial sums add up to the same bits in either all-reduce; under ``--deterministic`` the group
    gathers the partials and sums them in rank order, as the shared-memory one does."""
    path = checkpoints["llama-gqa"]
    bits = lambda done: [(c.token_ids, [(p.logprob.hex(), p.top) for p in c.logprobs]) for c in done]  # noqa: E731
    for deterministic in (False, True):
        runs = []
        for all_reduce in ("shm", "gloo"):
            engine = _engine(path, 2, tp_all_reduce=all_reduce, deterministic=deterministic)
            kind = type(engine.runner.tp.link._reduce).__name__
            assert kind == {"shm": "ShmAllReduce", "gloo": "ProcessGroupAllReduce"}[all_reduce]
            try:
                runs.append(bits(engine.generate(EIGHT_PROMPTS, GREEDY)))
                if deterministic:  # alone as in the batch of eight
                    assert bits(engine.generate(EIGHT_PROMPTS[3:4], GREEDY)) == runs[-1][3:4]
            finally:
                engine.close()
        assert runs[0] == runs[1]


def test_an_all_reduce_the_device_cannot_use_is_refused(checkpoints) -> None:
    from kvmesh.errors import FailedPrecondition

    path = checkpoints["llama-gqa"]
    with pytest.raises(InvalidArgument, match="'nccl' does not run on cpu ranks"):
        _engine(path, 2, tp_all_reduce="nccl")
    with pytest.raises(InvalidArgument, match="'shm' does not run on cuda ranks"):
        EngineConfig(device="cuda", tensor_parallel_size=2, tp_all_reduce="shm").resolve_tp_all_reduce()
    assert EngineConfig(device="cuda:2").resolve_tp_all_reduce() == "nccl"
    if torch.cuda.device_count() < 2:
        with pytest.raises(FailedPrecondition, match="GPUs cuda:0 to cuda:1; this machine has"):
            _engine(path, 2, device="cuda")


def test_step_inputs_cross_to_a_rank_s_device_whole() -> None:
    """What rank 0 sends a CUDA follower (token ids, attention metadata, a LoRA binding) is moved tensor by
    tensor, through tuples, dicts and dataclasses; everything else stays as it is."""
    from kernels.lora_segments import LoraSegments
    from kvmesh.engine.model import AttentionMetadata
    from kvmesh.engine.tensor_parallel import _moved

    meta = AttentionMetadata(*(torch.arange(4) for _ in range(4)), is_decode=True)
    lora = LoraSegments.build([(0, 2), (-1, 2)], torch.device("cpu"))
    step = (torch.arange(4), torch.arange(4), meta, (lora, frozenset({"qkv_proj"})))
    moved = _moved(step, "meta")
    tensors = [moved[0], moved[1], *vars(moved[2]).values(), *vars(moved[3][0]).values()]
    assert all(t.device.type == "meta" for t in tensors if isinstance(t, torch.Tensor))
    assert moved[2].is_decode is True and moved[3][1] == frozenset({"qkv_proj"})
    assert moved[3][0].num_slots == lora.num_slots


@pytest.mark.slow
def test_smollm2_over_three_ranks_gives_one_rank_s_greedy_tokens() -> None:
    """The real model (SmolLM2-135M-Instruct: 9 heads, 3 KV heads, one a rank) at TP3, float32."""
    from kvmesh.engine.default_model import default_model_path

    path = default_model_path()
    prompts = [[1, 504, 3458, 282, 4296, 314, 216] + [100 + 37 * i + k for i in range(5 * k)] for k in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    one = LLMEngine(path, EngineConfig(num_blocks=64)).generate(prompts, params)
    three = LLMEngine(path, EngineConfig(num_blocks=64, tensor_parallel_size=3))
    try:
        _close_enough(three.generate(prompts, params), one)
    finally:
        three.close()


@pytest.mark.parametrize("arch", ["llama-gqa", "llama3-rope"])
def test_blocks_leave_and_enter_whole_so_any_degree_reads_them(checkpoints, arch) -> None:
    """A block exported by two ranks is the one-rank layout (every KV head once, also where both ranks hold the
    same head), close to what one rank computes; one written in is what comes back out. Several at once (a
    hand-off's blocks, one exchange a rank) land each where it is named."""
    path = checkpoints[arch]
    prompt = EIGHT_PROMPTS[2]  # 50 tokens: three full blocks
    one, two = _engine(path, 1), _engine(path, 2)
    try:
        for engine in (one, two):
            engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        hashes = one.prompt_block_hashes(prompt, b"", None)[:3]
        (h0, a), *_ = one.export_blocks(hashes)
        (h1, b), *_ = two.export_blocks(hashes)
        assert h0 == h1 and a.shape == b.shape == two.kv.block_shape and len(b.data) == two.kv.block_nbytes
        x, y = (torch.frombuffer(bytearray(p.data), dtype=torch.float32) for p in (a, b))
        assert torch.allclose(x, y, atol=1e-5)
        block_id = two.reserve_blocks(1)[0]
        two.kv.import_block(block_id, a)
        assert two.kv.export_block(block_id).data == a.data
        assert two.kv.block_checksum(block_id) == one.kv.block_checksum(one.blocks.hash_to_block[h0])
        blocks = one.export_blocks(hashes)
        fresh = _engine(path, 2)
        try:
            assert fresh.import_blocks(blocks + blocks[:1]) == 3  # a name twice is adopted once
            assert fresh.import_blocks(blocks) == 0  # held already
            assert [p.data for _, p in fresh.export_blocks(hashes[::-1])] == [p.data for _, p in blocks[::-1]]
            # Checksums combined from the ranks' parts, the blocks left where they are, are the whole blocks'.
            ids = [fresh.blocks.hash_to_block[h] for h in hashes]
            assert fresh.kv.block_checksums(ids) == [checksum(p.data) for _, p in blocks]
            # A rank service (each rank's NIXL agent) that cannot start on a follower fails with its reason; the
            # group goes on stepping.
            with pytest.raises(FailedPrecondition, match="rank 1 could not start no_such_module: ModuleNotFound"):
                fresh.kv.group.start_rank_service("no_such_module", {})
            assert fresh.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0].token_ids
        finally:
            fresh.close()
    finally:
        two.close()
