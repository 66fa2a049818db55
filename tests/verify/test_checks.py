"""verify's measurements on known inputs: the coarsened top-k KL and the token-bytes agreement."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvmesh.verify.checks import agreed_tokens, topk_kl

BYTES = {b"a": 0, b"b": 1, b"c": 2, b"d": 3}


def _top(probs: list[float], tokens: list[bytes]) -> list[dict]:
    return [{"token": t.decode(), "bytes": list(t), "logprob": math.log(p)} for t, p in zip(tokens, probs)]


def test_topk_kl_is_zero_for_the_same_distribution_and_a_lower_bound_otherwise():
    gold = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert topk_kl(gold.log(), _top([0.5, 0.3], [b"a", b"b"]), BYTES) == pytest.approx(0.0, abs=1e-9)
    served = torch.tensor([0.4, 0.4, 0.1, 0.1])
    full = float((gold * (gold / served).log()).sum())
    coarse = topk_kl(gold.log(), _top([0.4, 0.4], [b"a", b"b"]), BYTES)
    by_hand = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert coarse == pytest.approx(by_hand) and 0 < coarse <= full


def test_topk_kl_skips_tokens_it_cannot_name():
    assert topk_kl(torch.zeros(4), _top([0.5], [b"zz"]), BYTES) is None


def test_agreement_counts_tokens_before_the_first_differing_bytes():
    golden = SimpleNamespace(token_keys=[{b"a"}, {b"b"}, {b"\xe2", "\ufffd".encode()}, {b"d"}])
    assert agreed_tokens(golden, [0, 1, 2, 3], [b"a", b"b", "\ufffd".encode(), b"d"]) == 4  # text-rendered partial
    assert agreed_tokens(golden, [0, 1, 3], [b"a", b"c", b"d"]) == 1
    assert agreed_tokens(golden, [0, 1], [b"a"]) == 1  # the served reply ended early


def test_the_endpoint_takes_the_openai_base_url_or_the_servers_root():
    from kvmesh.verify.checks import Endpoint

    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert Endpoint(url, None).url == "http://h:8000", url
