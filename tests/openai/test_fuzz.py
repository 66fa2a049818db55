"""Schemathesis fuzzes the API from its own /openapi.json: no 5xx, no hang, every answer as documented.

It runs against the guarded gateway (API keys on, one request in flight):
its document includes auth, and the admission limit keeps each generated
request to one sequence of at most the context's length, so the run stays
bounded on a CPU. Valid requests (by the schema) and invalid ones are both
generated; invalid ones must be refused with a 4xx.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis import checks as sc

from tests.openai.conftest import API_KEY

pytestmark = pytest.mark.timeout(900)

# 124 cases in all, most of them where the work is.
BUDGET = {
    GenerationMode.POSITIVE: {
        "POST /v1/completions": 20,
        "POST /v1/chat/completions": 20,
        "POST /v1/messages": 15,
        "POST /v1/responses": 10,
        "POST /tokenize": 3,
        "POST /detokenize": 3,
        "GET /v1/models": 2,
        "GET /v1/models/{model}": 2,
        "GET /health": 2,
        "GET /metrics": 2,
        "GET /openapi.json": 2,
    },
    GenerationMode.NEGATIVE: {
        "POST /v1/completions": 8,
        "POST /v1/chat/completions": 8,
        "POST /v1/messages": 8,
        "POST /v1/responses": 8,
    },
}
CHECKS = [
    sc.not_a_server_error,
    sc.status_code_conformance,
    sc.content_type_conformance,
    sc.response_schema_conformance,
]
# A generous bound per call: a hang fails the test instead of stalling the suite.
CALL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def schema(guarded):
    with urllib.request.urlopen(guarded.url + "/openapi.json", timeout=30) as r:
        return schemathesis.openapi.from_dict(json.load(r))


@pytest.mark.parametrize("mode", list(BUDGET), ids=lambda m: m.value)
def test_fuzz_the_openapi_document(guarded, schema, mode) -> None:
    checks = CHECKS + ([sc.negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    statuses: Counter[tuple[str, int]] = Counter()
    slowest = 0.0

    def call(case) -> None:
        nonlocal slowest
        start = time.perf_counter()
        response = case.call(
            base_url=guarded.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=CALL_TIMEOUT_S
        )
        slowest = max(slowest, time.perf_counter() - start)
        statuses[(case.operation.label, response.status_code)] += 1
        case.validate_response(response, checks=checks)

    for label, cases in BUDGET[mode].items():
        method, path = label.split(" ")
        fuzz = settings(
            max_examples=cases,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(given(case=schema[path][method].as_strategy(mode))(call))
        fuzz()

    print(
        f"\nfuzz ({mode.value}): {sum(statuses.values())} cases, slowest {slowest:.2f} s; "
        + ", ".join(f"{op} {status}: {n}" for (op, status), n in sorted(statuses.items()))
    )
    assert statuses and not any(status >= 500 for _, status in statuses)
