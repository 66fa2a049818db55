"""The EAGLE head: trained in seconds on a tiny target, then drafting for it.

Greedy output is identical with every source; sampled output is distributed as
the target's (chi-square, with and without speculation); a head trained for
another target is refused; with the speculator service gone mid-stream, decode
goes on, drafting with the head alone.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampler import verify
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter
from kvmesh.speculation.eagle import EagleProposer, RemoteWithHead
from kvmesh.speculation.local import LocalProposer
from kvmesh.training import eagle as train_eagle
from tests.engine.conftest import PROMPTS, resolved, write_checkpoint
from tests.service_helpers import free_port

from .conftest import connected, eventually, proposer_for, speculator_on

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("eagle") / "target", "llama-gqa")


@pytest.fixture(scope="module")
def traffic(target, tmp_path_factory) -> Path:
    """The target's own greedy continuations, as a speculator's retained traffic: of random
    prompts, and of the prompts the tests serve (a random target's text is no language a head
    can generalise from, so only what it has seen shows that serving hands it the features it
    was trained on)."""
    engine = LLMEngine(target, EngineConfig(num_blocks=256))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 500, (8,), generator=gen).tolist() for _ in range(48)] + PROMPTS
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True))
    path = tmp_path_factory.mktemp("eagle-traffic") / "traffic.jsonl"
    path.write_text("".join(json.dumps({"token_ids": c.prompt_ids + c.token_ids}) + "\n" for c in done))
    return path


def _train_head(target: Path, traffic: Path, root: Path, *flags: str) -> Path:
    """A head trained on ``traffic`` in a seconds-long run."""
    out = root / "head"
    rc = train_eagle.main(
        [
            "--model",
            str(target),
            "--data",
            f"traffic={traffic}",
            "--out",
            str(out),
            "--cache",
            str(root / "cache"),
            "--window",
            "64",
            "--intermediate",
            "128",
            "--draft-vocab",
            "512",
            "--unroll",
            "2",
            "--epochs",
            "8",
            "--batch",
            "64",
            "--lr",
            "5e-3",
            "--threads",
            "1",
            *flags,
        ]
    )
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def head(target, traffic, tmp_path_factory) -> Path:
    return _train_head(target, traffic, tmp_path_factory.mktemp("eagle-head"))


@pytest.fixture(scope="module")
def layered_head(target, traffic, tmp_path_factory) -> Path:
    """EAGLE-3 style: drafts from the outputs of both of the target's layers."""
    return _train_head(target, traffic, tmp_path_factory.mktemp("eagle-layered"), "--feature-layers", "0,1")


def _greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_the_head_folder_holds_its_config_and_no_target_weights(head):
    meta = json.loads((head / "config.json").read_text())
    assert meta["format"] == "kvmesh-eagle-v1" and len(meta["target"]["fingerprint"]) == 32
    assert meta["training"]["data"].startswith("traffic=")
    from safetensors.torch import load_file

    tensors = load_file(str(head / "head.safetensors"))
    assert "draft_vocab" in tensors
    # The target's embedding / LM head are [vocab, hidden]: nothing of that shape is stored.
    assert all(t.dim() == 1 or t.shape[0] != meta["target"]["vocab_size"] for t in tensors.values())


def test_greedy_output_identical_with_every_source(target, head):
    expected = [c.token_ids for c in LLMEngine(target, EngineConfig(num_blocks=128)).generate(PROMPTS, _greedy())]
    for name, proposer in [
        ("eagle", EagleProposer(head)),
        ("ngram", LocalProposer()),
        ("merged", LocalProposer(head=EagleProposer(head))),
    ]:
        engine = LLMEngine(target, EngineConfig(num_blocks=128), drafter=Drafter(proposer, 4))
        assert [c.token_ids for c in engine.generate(PROMPTS, _greedy())] == expected, name
        if name != "ngram":
            assert engine.stats.draft_tokens_proposed > 0, name
        assert engine.blocks.num_free == 128


def test_a_layered_head_drafts_from_the_target_layers_it_names(target, layered_head):
    meta = json.loads((layered_head / "config.json").read_text())
    assert meta["head"]["feature_layers"] == [0, 1] and meta["training"]["feature_layers"] == [0, 1]
    expected = [c.token_ids for c in LLMEngine(target, EngineConfig(num_blocks=128)).generate(PROMPTS, _greedy())]
    for name, proposer in [
        ("eagle", EagleProposer(layered_head)),
        ("merged", LocalProposer(head=EagleProposer(layered_head))),
    ]:
        engine = LLMEngine(target, EngineConfig(num_blocks=128), drafter=Drafter(proposer, 4))
        assert engine.model.feature_layers == (0, 1)
        assert [c.token_ids for c in engine.generate(PROMPTS, _greedy())] == expected, name
        assert engine.stats.draft_tokens_accepted > 0, name
        assert engine.blocks.num_free == 128


def test_a_head_drafts_from_a_target_split_over_two_ranks(target, layered_head):
    """Tensor parallelism: rank 0 holds the whole residual stream after each layer's all-reduce, so the
    features a head drafts from are gathered already; the drafts are accepted as at one rank. No measured
    verify prices (``costs=()``): a draft length chosen by this noisy machine's timings would differ per engine."""
    one = LLMEngine(target, EngineConfig(num_blocks=128), drafter=Drafter(EagleProposer(layered_head), 4, costs=()))
    expected = [c.token_ids for c in one.generate(PROMPTS, _greedy())]
    config = EngineConfig(num_blocks=128, tensor_parallel_size=2)
    two = LLMEngine(target, config, drafter=Drafter(EagleProposer(layered_head), 4, costs=()))
    try:
        assert [c.token_ids for c in two.generate(PROMPTS, _greedy())] == expected
        assert two.stats.draft_tokens_accepted == one.stats.draft_tokens_accepted > 0
    finally:
        two.close()


@pytest.mark.native_cpu
def test_under_deterministic_serving_every_source_keeps_the_bits_of_no_speculation(target, layered_head):
    """--deterministic: the same token ids and logprobs, bit for bit, with EAGLE, n-gram or merged drafts as
    without speculation, greedy and seeded (a sampled verify row keeps plain decoding's draw)."""

    def bits(drafter, params: SamplingParams) -> list:
        engine = LLMEngine(target, EngineConfig(num_blocks=128, deterministic=True), drafter=drafter)
        done = engine.generate(PROMPTS, params)
        return [(c.token_ids, [(lp.logprob.hex(), lp.top) for lp in c.logprobs]) for c in done], engine.stats

    for params in (
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=3),
    ):
        expected, _ = bits(None, params)
        for name, proposer in [
            ("eagle", EagleProposer(layered_head)),
            ("ngram", LocalProposer()),
            ("merged", LocalProposer(head=EagleProposer(layered_head))),
        ]:
            got, stats = bits(Drafter(proposer, 4), params)
            assert got == expected, f"{name}, temperature {params.temperature}"
            if name != "ngram":
                assert stats.draft_tokens_accepted > 0, name


def test_a_compiled_target_traces_the_layers_a_head_drafts_from(target, layered_head):
    """The proposer is bound before the decode step is compiled, so the compiled graph returns the
    layer features (a graph traced for the final hidden state would hand the head the wrong input)."""
    expected = [c.token_ids for c in LLMEngine(target, EngineConfig(num_blocks=128)).generate(PROMPTS, _greedy())]
    # Always 4 drafts: each engine measures its own verify costs, and a compiled one's differ.
    eager = LLMEngine(
        target,
        EngineConfig(num_blocks=128),
        drafter=Drafter(EagleProposer(layered_head), 4, ()),
    )
    compiled = LLMEngine(
        target,
        EngineConfig(num_blocks=128, compile=True),
        drafter=Drafter(EagleProposer(layered_head), 4, ()),
    )
    for engine in (eager, compiled):
        assert [c.token_ids for c in engine.generate(PROMPTS, _greedy())] == expected
    assert compiled.stats.draft_tokens_accepted == eager.stats.draft_tokens_accepted > 0


def test_a_head_naming_layers_the_target_lacks_is_refused(target, layered_head, tmp_path):
    bad = tmp_path / "head"
    shutil.copytree(layered_head, bad)
    meta = json.loads((bad / "config.json").read_text())
    meta["head"]["feature_layers"] = [0, 5]
    (bad / "config.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidArgument, match="past the target's 2 layers"):
        LLMEngine(target, EngineConfig(num_blocks=32), drafter=Drafter(EagleProposer(bad), 2))


def test_the_last_layers_output_normed_is_the_final_hidden_state(target):
    """The layer taps are the residual stream after each layer: the last one, through the final
    norm, is what the LM head reads (the feature a head without layers drafts from)."""
    engine = LLMEngine(target, EngineConfig(num_blocks=32), drafter=Drafter(LocalProposer(), 2))
    model = engine.model
    ids = torch.tensor(PROMPTS[0])
    n = len(ids)
    from kvmesh.engine.model import AttentionMetadata

    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(2).unsqueeze(0),
        seq_lens=torch.tensor([n]),
        query_start_loc=torch.tensor([0, n]),
        is_decode=False,
    )
    rows = torch.arange(n)
    _, final = model(ids, torch.arange(n), engine.kv.tensor, meta, rows, return_hidden=True)
    model.feature_layers = (0, 1)
    _, layered = model(ids, torch.arange(n), engine.kv.tensor, meta, rows, return_hidden=True)
    assert layered.shape == (n, 2 * final.shape[1])
    last = layered[:, final.shape[1] :]
    assert torch.allclose(model.ops.rms_norm(last, model.norm, model.cfg.rms_norm_eps), final, atol=1e-5)


def test_merged_acceptance_is_counted_per_source(target, head):
    proposer = LocalProposer(head=EagleProposer(head))
    engine = LLMEngine(target, EngineConfig(num_blocks=128), drafter=Drafter(proposer, 4))
    engine.generate([list(range(300, 320)) * 3, *PROMPTS], _greedy(32))
    stats = proposer.speculator.stats()
    assert stats.proposed_by_source["eagle"] > 0
    assert sum(stats.accepted_by_source.values()) == stats.accepted_tokens == engine.stats.draft_tokens_accepted
    assert stats.accepted_by_source["eagle"] <= stats.proposed_by_source["eagle"]


def test_a_head_for_another_target_is_refused(head, tmp_path):
    other = write_checkpoint(tmp_path / "other", "llama-gqa", seed=7)  # same shapes, other weights
    with pytest.raises(InvalidArgument, match="another target"):
        LLMEngine(other, EngineConfig(num_blocks=32), drafter=Drafter(EagleProposer(head), 2))


def _chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a two-sample chi-square test of homogeneity (Wilson-Hilferty approximation)."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        tot = a[k] + b[k]
        for n, obs in ((na, a[k]), (nb, b[k])):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(keys) - 1
    if df <= 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    """verify() alone, k=1: drafts drawn from q != p; the emitted first token must follow p —
    and the point-mass rule applied to the same q-drawn drafts too (both are exact)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * 6])
    q = torch.softmax(torch.tensor([0.0, 2.0, 1.0, 1.0, 0.5, -1.0]), dim=0)
    p = torch.softmax(logits[0], dim=0)
    params = resolved(temperature=1.0, max_tokens=2)
    n = 20_000
    for use_q in (True, False):
        counts = Counter()
        for _ in range(n):
            d = int(torch.multinomial(q, 1, generator=gen))
            counts[verify(logits, [d], params, [gen] * 2, [0, 0], q.unsqueeze(0) if use_q else None)[0]] += 1
        expected = Counter({i: round(float(p[i]) * n) for i in range(6)})
        assert _chi_square_p(counts, expected) > 1e-3, (use_q, counts)
    # The test can fail: accepting every draft gives q's distribution, not p's.
    wrong = Counter(int(torch.multinomial(q, 1, generator=gen)) for _ in range(n))
    assert _chi_square_p(wrong, expected) < 1e-6


def test_sampled_output_distributed_as_without_speculation(target, head):
    """Many seeded samples (top-k 6: a small vocabulary slice) of the 2nd..4th tokens, with the
    head sampling drafts from its own distribution and without speculation."""
    prompt = PROMPTS[0]
    n = 300

    def samples(proposer) -> dict[int, Counter]:
        engine = LLMEngine(target, EngineConfig(num_blocks=512), drafter=Drafter(proposer, 3) if proposer else None)
        params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(n)]
        out = engine.generate([prompt] * n, params)
        if proposer is not None:
            assert engine.stats.draft_tokens_proposed > 0
        return {i: Counter(c.token_ids[i] for c in out) for i in (1, 2, 3)}

    plain = samples(None)
    spec = samples(EagleProposer(head))
    for i in (1, 2, 3):
        assert _chi_square_p(plain[i], spec[i]) > 1e-3, (i, plain[i], spec[i])


async def test_speculator_down_mid_stream_decode_continues_with_the_head(target, head):
    expected = [c.token_ids for c in LLMEngine(target, EngineConfig(num_blocks=128)).generate(PROMPTS, _greedy(40))]
    port = free_port()
    async with proposer_for(port) as (remote, _):
        proposer = RemoteWithHead(remote, EagleProposer(head))
        engine = LLMEngine(target, EngineConfig(num_blocks=128), drafter=Drafter(proposer, 3))
        for p in PROMPTS:
            engine.add_request(p, _greedy(40))
        got: dict[str, list[int]] = {}

        def steps(n: int) -> None:
            for _ in range(n):
                for out in engine.step():
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)

        async with speculator_on(port):
            await connected(remote)
            await asyncio.to_thread(steps, 4)

        async def down() -> bool:
            return not remote.connected

        await eventually(down)
        before = engine.stats.draft_tokens_proposed
        while engine.has_unfinished():
            await asyncio.to_thread(steps, 1)
        assert engine.stats.draft_tokens_proposed > before  # the head kept drafting
        assert [got[f"req-{i}"] for i in range(len(PROMPTS))] == expected
