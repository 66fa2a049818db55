"""The speculator with a draft model (``--draft-model``): the shipped ``models/pycode-draft``
drafts where the n-gram sources find no good match, in one batched call per message, and
a folder that does not load stops the service before it starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvmesh.api.speculator.v1 import speculator_pb2_grpc
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.runtime import common_flags, parse_flags
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.candidate import Source
from kvmesh.speculation.draft_model import DraftModelProposer, DraftRequest
from kvmesh.speculation.drafter import Drafter
from kvmesh.speculation.speculator import DRAFT_MODEL_MATCH_TOKENS, Speculator, SpeculatorConfig
from services.speculator import main
from services.speculator.draft_worker import DraftModelWorker
from tests.models.conftest import CODE_PROMPTS, DRAFT, SMALL
from tests.service_helpers import serve_main

from .conftest import ProposeStream, batch, connected, proposer_for, update

REPO = Path(__file__).resolve().parents[2]
K = 4
# Distinct ids: neither prompt lookup nor an empty suffix index can match any of it.
NO_REPEATS = list(range(300, 340))
PASSAGE = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]


def with_draft_model(match_tokens: int = DRAFT_MODEL_MATCH_TOKENS) -> Speculator:
    return Speculator(SpeculatorConfig(draft_model_match_tokens=match_tokens))


def greedy_draft(context: list[int], k: int = K) -> list[int]:
    """What a fresh DraftModelProposer drafts for ``context``: the reference."""
    return DraftModelProposer(DRAFT).draft([DraftRequest("ref", context, k)])["ref"]


@pytest.fixture(scope="module")
def proposer() -> DraftModelProposer:
    return DraftModelProposer(DRAFT)


# -- the core ----------------------------------------------------------------------------------------------


def test_without_an_ngram_match_the_draft_model_drafts(proposer):
    spec = with_draft_model()
    s = spec.open_session()
    s.update("r", NO_REPEATS, len(NO_REPEATS))
    plan = s.plan("r", K)
    assert plan.ngram is None and plan.model_context == NO_REPEATS

    drafts = proposer.draft([DraftRequest(plan.request_id, plan.model_context, plan.num_tokens)])
    draft = s.decide(plan, drafts["r"])
    assert draft.source is Source.DRAFT_MODEL
    assert draft.token_ids == greedy_draft(NO_REPEATS) and len(draft.token_ids) == K
    stats = spec.stats()
    assert stats.proposals == {"prompt": 0, "suffix": 0, "draft_model": 1, "eagle": 0}
    assert stats.proposed_tokens == K


def test_an_ngram_match_at_least_as_long_wins_and_the_model_is_not_asked():
    s = with_draft_model(match_tokens=5).open_session()
    # The tail "101..105" repeats the passage's start: a 5-token match, a full-length draft.
    context = PASSAGE + [7, 8] + PASSAGE[:5]
    s.update("r", context, len(context))
    plan = s.plan("r", K)
    assert plan.ngram.match_length == 5 and plan.model_context is None
    draft = s.decide(plan, [])
    assert (draft.source, draft.token_ids) == (Source.PROMPT, PASSAGE[5:9])


def test_a_shorter_ngram_match_loses_to_the_model(proposer):
    spec = with_draft_model(match_tokens=5)
    s = spec.open_session()
    context = PASSAGE + [7, 8] + PASSAGE[:4]
    s.update("r", context, len(context))
    plan = s.plan("r", K)
    assert plan.ngram.match_length == 4 and plan.model_context == context

    model_draft = proposer.draft([DraftRequest("r", plan.model_context, plan.num_tokens)])["r"]
    draft = s.decide(plan, model_draft)
    assert (draft.source, draft.token_ids) == (Source.DRAFT_MODEL, greedy_draft(context))
    # No model draft after all (e.g. a context at the model's limit): the n-gram one goes.
    assert s.decide(plan, []).source is Source.PROMPT
    assert spec.stats().proposals == {"prompt": 1, "suffix": 0, "draft_model": 1, "eagle": 0}


def test_without_a_draft_model_nothing_asks_for_one():
    s = Speculator(SpeculatorConfig()).open_session()
    s.update("r", NO_REPEATS, len(NO_REPEATS))
    plan = s.plan("r", K)
    assert plan.model_context is None and s.decide(plan, []) is None


def test_a_late_plan_is_counted_and_skipped():
    spec = with_draft_model()
    s = spec.open_session()
    s.update("r", NO_REPEATS, len(NO_REPEATS))
    assert s.plan("r", K, deadline_ns=time.perf_counter_ns() - 1) is None
    plan = s.plan("r", K)
    assert s.decide(plan, [1, 2, 3, 4], deadline_ns=time.perf_counter_ns() - 1) is None
    stats = spec.stats()
    assert (stats.late_drafts, stats.proposed_tokens) == (2, 0)


@pytest.mark.parametrize("match_tokens", [-1, 33])
def test_the_match_length_must_be_one_a_match_can_have(match_tokens):
    with pytest.raises(ValueError, match="draft_model_match_tokens"):
        SpeculatorConfig(draft_model_match_tokens=match_tokens)


# -- the worker thread ---------------------------------------------------------------------------------------


async def test_the_worker_drafts_a_round_in_one_call_off_the_loop(monkeypatch):
    contexts = {"a": NO_REPEATS, "b": NO_REPEATS[:20], "c": [5, 9, 13, 17]}
    expected = {rid: greedy_draft(context) for rid, context in contexts.items()}
    calls = _count_draft_calls(monkeypatch)
    s = with_draft_model().open_session()
    for rid, context in contexts.items():
        s.update(rid, context, len(context))
    worker = DraftModelWorker(str(DRAFT))
    await worker.start()
    try:
        assert await worker.draft([s.plan(rid, K) for rid in contexts]) == expected
        # One call for the three, on the worker's thread (ThreadPoolExecutor names it <prefix>_0).
        assert calls == [(3, "draft-model_0")]

        # A deadline already passed: nothing comes back.
        assert await worker.draft([s.plan("a", K)], deadline_ns=time.perf_counter_ns()) == {}
        # Token ids beyond the model's vocabulary (it does not share the target's tokenizer):
        # no drafts for that round, and the next one drafts again.
        s.update("alien", [11, 100_000], 2)
        assert await worker.draft([s.plan("a", K), s.plan("alien", K)]) == {}
        assert await worker.draft([s.plan("a", K)]) == {"a": expected["a"]}
    finally:
        await worker.close()


# -- the service ------------------------------------------------------------------------------------------


async def test_the_service_drafts_with_the_model_where_ngrams_cannot(monkeypatch):
    # A verbatim repeat (prompt lookup wins over the model) and contexts nothing matches.
    n = DRAFT_MODEL_MATCH_TOKENS
    repeat = PASSAGE + [7] + PASSAGE[:n]
    x, y = NO_REPEATS[:25], [900, 901, 902, 903, 904]
    expected = {"alone": greedy_draft(NO_REPEATS), "x": greedy_draft(x), "y": greedy_draft(y)}
    calls = _count_draft_calls(monkeypatch)
    async with serve_main("speculator", main, ["--draft-model", str(DRAFT)]) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            s = ProposeStream(speculator_pb2_grpc.SpeculatorServiceStub(channel))
            s.send(update("alone", NO_REPEATS, len(NO_REPEATS), k=K))
            r = await s.recv()
            assert (r.request_id, list(r.draft_token_ids)) == ("alone", expected["alone"])

            s.send(
                batch(
                    update("repeat", repeat, len(repeat), k=K), update("x", x, len(x), k=K), update("y", y, len(y), k=K)
                )
            )
            r = await s.recv()
            assert [(d.request_id, list(d.token_ids)) for d in r.drafts] == [
                ("repeat", repeat[n : n + K]),
                ("x", expected["x"]),
                ("y", expected["y"]),
            ]
            # One model call per message, with only the contexts the model could win.
            assert [size for size, _ in calls] == [1, 2]
            await s.close()
        assert _proposals(rt.metrics_port) == {"prompt": 1, "suffix": 0, "draft_model": 3, "eagle": 0}


async def test_a_decode_engine_speculating_through_the_service_keeps_its_output_and_accepts_model_drafts():
    """The decode worker's wiring against the shipped target model: its greedy output is the
    same as without speculation, and drafts from the service's draft model get accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def plain() -> tuple[list[list[int]], list[list[int]]]:
        engine = LLMEngine(SMALL, EngineConfig(num_blocks=128))
        prompts = [engine.tokenizer.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
        return prompts, [c.token_ids for c in engine.generate(prompts, params)]

    prompts, expected = await asyncio.to_thread(plain)
    async with serve_main("speculator", main, ["--draft-model", str(DRAFT)]) as rt, proposer_for(rt.port) as (p, _):
        await connected(p)
        engine = await asyncio.to_thread(LLMEngine, SMALL, EngineConfig(num_blocks=128), drafter=Drafter(p, K))
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            got = await asyncio.gather(*(_generate(aengine, q, params, str(i)) for i, q in enumerate(prompts)))
        finally:
            await asyncio.to_thread(aengine.stop)
        assert got == expected
        assert engine.stats.draft_tokens_accepted > 0
        assert _proposals(rt.metrics_port)["draft_model"] > 0


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_draft_model_that_does_not_load_stops_the_service_at_once(how, tmp_path, capsys):
    (tmp_path / "config.json").write_text((DRAFT / "config.json").read_text())  # but no weights
    if how == "flag":
        argv, env = ["--draft-model", str(tmp_path)], {}
    else:
        argv, env = [], {"KVMESH_DRAFT_MODEL": str(tmp_path)}
    with pytest.raises(SystemExit) as info:
        parse_flags("speculator", [*common_flags(0, 0), *main.FLAGS], argv, environ=env)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} does not load as a model folder" in err and "no *.safetensors weights found" in err


def test_the_process_exits_2_for_a_missing_folder():
    proc = subprocess.run(
        [sys.executable, "-m", "services.speculator.main", "--draft-model", "/nonexistent/draft", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "/nonexistent/draft does not load as a model folder" in proc.stderr


def test_a_speculator_without_a_draft_model_never_loads_torch():
    code = "import sys, services.speculator.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120).returncode == 0


# -- helpers -------------------------------------------------------------------------------------------------


async def _generate(aengine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for out in aengine.generate(prompt, params, request_id):
        tokens += out.new_token_ids
    return tokens


def _count_draft_calls(monkeypatch) -> list[tuple[int, str]]:
    """Record each DraftModelProposer.draft call's batch size and thread name (the real call runs)."""
    calls: list[tuple[int, str]] = []
    real = DraftModelProposer.draft

    def counted(self, requests):
        calls.append((len(requests), threading.current_thread().name))
        return real(self, requests)

    monkeypatch.setattr(DraftModelProposer, "draft", counted)
    return calls


def _proposals(metrics_port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    prefix = 'kvmesh_speculator_proposals_total{source="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.split()[-1])
        for line in body.splitlines()
        if line.startswith(prefix)
    }
