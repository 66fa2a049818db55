"""The speculator core: prompt lookup, the shared suffix index, and their bookkeeping."""

from __future__ import annotations

import random
import time

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.speculation.candidate import MAX_MATCH_TOKENS, Candidate, Source, better
from kvmesh.speculation.speculator import Speculator, SpeculatorConfig

PASSAGE = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]


def fresh(**config) -> Speculator:
    return Speculator(SpeculatorConfig(**config))


def test_prompt_lookup_continues_a_repeated_passage():
    session = fresh().open_session()
    context = [1, 2, 3] + PASSAGE + [7, 8] + PASSAGE[:5]
    session.update("r", context, len(context))
    draft = session.propose("r", 4)
    assert draft is not None
    assert draft.token_ids == PASSAGE[5:9]
    assert draft.source is Source.PROMPT
    assert draft.match_length == 5


def test_prompt_lookup_copies_through_a_short_cycle():
    """With the last occurrence only p tokens back, the draft repeats the period-p cycle."""
    session = fresh().open_session()
    context = [50, 7, 8, 9, 7, 8, 9, 7, 8]
    session.update("r", context, len(context))
    assert session.propose("r", 7).token_ids == [9, 7, 8, 9, 7, 8, 9]


def test_the_longest_match_wins_over_the_most_recent_short_one():
    session = fresh().open_session()
    # "3 4" was last followed by 60, but "1 2 3 4" (a longer match) by 50.
    context = [1, 2, 3, 4, 50, 51, 9, 9, 3, 4, 60, 61, 1, 2, 3, 4]
    session.update("r", context, len(context))
    draft = session.propose("r", 2)
    assert draft.token_ids == [50, 51]
    assert draft.match_length == 4


def test_nothing_to_propose_for_text_that_never_repeats():
    session = fresh().open_session()
    session.update("r", list(range(200, 260)), 60)
    assert session.propose("r", 4) is None
    assert session.propose("unknown", 4) is None


def test_drafts_are_capped_at_max_draft_tokens():
    session = fresh(max_draft_tokens=3).open_session()
    context = PASSAGE + PASSAGE[:4]
    session.update("r", context, len(context))
    assert session.propose("r", 8).token_ids == PASSAGE[4:7]


def _reference_prompt_lookup(context: list[int], sizes: tuple[int, ...], k: int) -> tuple[list[int], int] | None:
    """The rule by definition, rescanning the whole context: for each n (longest first) the
    most recent earlier occurrence of the last n tokens, the one matching furthest back wins."""
    length = len(context)
    best = None
    for n in sorted(sizes, reverse=True):
        if length <= n:
            continue
        tail = context[-n:]
        for end in range(length - 1, n - 1, -1):
            if context[end - n : end] == tail:
                m = 0
                while m < min(MAX_MATCH_TOKENS, end) and context[end - 1 - m] == context[length - 1 - m]:
                    m += 1
                if best is None or m > best[1]:
                    best = (end, m)
                break
    if best is None:
        return None
    end, m = best
    draft = []
    for j in range(k):
        draft.append(context[end + j] if end + j < length else draft[end + j - length])
    return draft, m


def test_incremental_updates_equal_full_context_results():
    rng = random.Random(7)
    sizes = (4, 3, 2)
    incremental = fresh(prompt_ngram_sizes=sizes).open_session()
    context: list[int] = []
    while len(context) < 600:
        # A small vocabulary and copied runs make matches of every length common.
        if context and rng.random() < 0.3:
            start = rng.randrange(len(context))
            new = context[start : start + rng.randint(1, 6)]
        else:
            new = [rng.randrange(12) for _ in range(rng.randint(1, 3))]
        context += new
        incremental.update("r", new, len(context))
        whole = fresh(prompt_ngram_sizes=sizes).open_session()
        whole.update("r", list(context), len(context))
        k = rng.randint(1, 8)
        a, b = incremental.propose("r", k), whole.propose("r", k)
        expected = _reference_prompt_lookup(context, sizes, k)
        assert a == b
        if expected is None:
            assert a is None
        else:
            assert (a.token_ids, a.match_length) == expected


def test_suffix_index_drafts_for_a_new_request_from_a_finished_one():
    spec = fresh()
    worker_a, worker_b = spec.open_session(), spec.open_session()
    prompt = list(range(300, 340))
    output = list(range(500, 530))
    worker_a.update("a", prompt, len(prompt))
    worker_a.update("a", output, len(prompt) + len(output))
    worker_a.finish("a", learn=True)
    assert spec.stats().indexed_tokens == len(prompt) + len(output)
    assert spec.stats().active_requests == 0

    # Another worker's request quotes the same text: it drafts what followed.
    context = [9, 9, 9] + prompt[-10:] + output[:3]
    worker_b.update("b", context, len(context))
    draft = worker_b.propose("b", 5)
    assert draft.token_ids == output[3:8]
    assert draft.source is Source.SUFFIX
    assert spec.stats().proposals == {"prompt": 0, "suffix": 1, "draft_model": 0, "eagle": 0}


def test_a_suffix_draft_stops_at_the_end_of_the_learned_sequence():
    spec = fresh()
    s = spec.open_session()
    learned = list(range(40, 60))
    s.update("a", learned, len(learned))
    s.finish("a", learn=True)
    s.update("b", learned[-6:-2], 4)
    assert s.propose("b", 8).token_ids == learned[-2:]


def test_unlearned_requests_teach_nothing():
    spec = fresh()
    s = spec.open_session()
    s.update("a", list(range(300, 340)), 40)
    s.finish("a", learn=False)
    s.update("b", list(range(310, 320)), 10)
    assert s.propose("b", 4) is None
    assert spec.stats().indexed_tokens == 0


def test_capacity_evicts_the_oldest_sequences():
    spec = fresh(suffix_capacity_tokens=100)
    s = spec.open_session()
    old, new = list(range(1000, 1060)), list(range(2000, 2060))
    for rid, tokens in (("old", old), ("new", new)):
        s.update(rid, tokens, len(tokens))
        s.finish(rid, learn=True)
    stats = spec.stats()
    assert stats.indexed_tokens == 60 and stats.indexed_sequences == 1
    s.update("q-old", old[10:20], 10)
    s.update("q-new", new[10:20], 10)
    assert s.propose("q-old", 4) is None
    assert s.propose("q-new", 4).token_ids == new[20:24]


def test_eviction_keeps_memory_bounded_over_many_sequences():
    spec = fresh(suffix_capacity_tokens=5_000)
    rng = random.Random(3)
    s = spec.open_session()
    for i in range(300):
        tokens = [rng.randrange(5000) for _ in range(rng.randint(50, 400))]
        s.update(str(i), tokens, len(tokens))
        s.finish(str(i), learn=True)
        assert spec.suffix_index.held_tokens <= 5_000
    # Every n-gram entry left belongs to a held sequence: at most one per size per token.
    assert len(spec.suffix_index._index) <= 3 * spec.suffix_index.held_tokens
    assert len(spec.suffix_index._stream) <= 2 * 5_000 + (1 << 16)


def test_an_exact_repeat_is_learned_once():
    spec = fresh()
    s = spec.open_session()
    for rid in ("a", "b"):
        s.update(rid, PASSAGE * 2, 24)
        s.finish(rid, learn=True)
    assert spec.stats().indexed_sequences == 1
    assert spec.stats().indexed_tokens == 24


def test_deferred_indexing_finds_a_sequence_once_maintained():
    spec = fresh(defer_indexing=True)
    s = spec.open_session()
    learned = list(range(700, 800))
    s.update("a", learned, len(learned))
    s.finish("a", learn=True)
    assert spec.stats().indexing_backlog_tokens == 100
    s.update("b", learned[30:40], 10)
    assert s.propose("b", 3) is None  # held, not yet indexed

    assert spec.maintain_index(60) is True
    assert spec.maintain_index(60) is False
    assert spec.stats().indexing_backlog_tokens == 0
    assert s.propose("b", 3).token_ids == learned[40:43]


def test_counters_and_late_drafts():
    spec = fresh()
    s = spec.open_session()
    context = PASSAGE + PASSAGE[:4]
    s.update("r", context, len(context))
    assert len(s.propose("r", 4).token_ids) == 4
    s.update("r", PASSAGE[4:7], len(context) + 3, accepted_draft_tokens=3)
    # A deadline already behind us: the draft is computed but neither sent nor counted.
    assert s.propose("r", 4, deadline_ns=time.perf_counter_ns() - 1) is None
    stats = spec.stats()
    assert (stats.proposed_tokens, stats.accepted_tokens, stats.late_drafts) == (4, 3, 1)
    assert stats.acceptance_rate == 0.75


def test_sessions_keep_same_named_requests_apart_and_close_drops_state():
    spec = fresh()
    a, b = spec.open_session(), spec.open_session()
    a.update("req-0", PASSAGE + PASSAGE[:2], 14)
    b.update("req-0", [5, 6, 7, 5, 6], 5)
    assert a.propose("req-0", 2).token_ids == PASSAGE[2:4]
    assert b.propose("req-0", 2).token_ids == [7, 5]
    assert spec.stats().active_requests == 2
    a.close()
    assert spec.stats().active_requests == 1
    b.finish("req-0", learn=False)
    assert spec.stats().active_requests == 0


def test_an_update_out_of_step_restarts_the_request_from_what_it_carries():
    s = fresh().open_session()
    s.update("r", [1, 2, 3], 3)
    # Two tokens were lost: the context is 10 long, and only its last 7 are known now.
    tail = PASSAGE[:4] + PASSAGE[:3]
    s.update("r", tail, 10)
    assert s.propose("r", 2).token_ids == [PASSAGE[3], PASSAGE[0]]
    # ...and the next update continues it (were it taken as out of step too, one token would be all it knew).
    s.update("r", [PASSAGE[3]], 11)
    assert s.propose("r", 2).token_ids == PASSAGE[:2]
    # A full resend (a reconnected worker) starts over cleanly.
    s.update("r", PASSAGE + PASSAGE[:2], 14)
    assert s.propose("r", 2).token_ids == PASSAGE[2:4]


def test_malformed_updates_are_refused():
    s = fresh().open_session()
    with pytest.raises(InvalidArgument, match="request_id"):
        s.update("", [1], 1)
    with pytest.raises(InvalidArgument, match="context_length 1 is less than the 2 tokens"):
        s.update("r", [1, 2], 1)


def test_the_combination_rule():
    own = Candidate([1, 2], Source.PROMPT, 5)
    assert better(own, Candidate([3, 4], Source.SUFFIX, 6)).source is Source.SUFFIX  # longer match
    assert better(own, Candidate([3, 4, 5], Source.SUFFIX, 5)).source is Source.SUFFIX  # then longer draft
    assert better(own, Candidate([3, 4], Source.SUFFIX, 5)) is own  # then the request's own context
    assert better(None, own) is own and better(own, None) is own and better(None, None) is None


@pytest.mark.parametrize(
    "config",
    [
        dict(prompt_ngram_sizes=(0, 2)),
        dict(suffix_ngram_sizes=()),
        dict(max_draft_tokens=0),
        dict(suffix_capacity_tokens=8),
    ],
)
def test_bad_configs_fail_at_construction(config):
    with pytest.raises(ValueError):
        fresh(**config)
