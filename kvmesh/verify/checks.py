"""``kvmesh verify``'s checks of a served endpoint against the golden implementation.

Each check returns a ``Check`` (name, measured value, pass/fail, why). Greedy agreement walks
the golden tokens while each one's bytes equal the served token's (``logprobs.content[i].bytes``):
the tokens before the first divergence (raw bytes or the UTF-8 of the token's text, which is
what endpoints that render partial UTF-8 tokens as U+FFFD send). KL uses the served
``top_logprobs``: at agreeing positions the golden full-vocabulary distribution and the served
one are both coarsened to {its top-k tokens, the rest}, and KL(golden || served) over those k+1
outcomes is a lower bound on the full KL (data processing), computable against any endpoint that
returns top logprobs.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import jsonschema

from kvmesh.verify.golden import Golden

PROMPTS = (
    "What is the capital of Japan?",
    "Write a Python function that reverses a string.",
    "Give me two tips for learning a new language.",
    "Explain photosynthesis in one paragraph.",
    "What is 12 times 7?",
    "Name three colors of the rainbow.",
)
WEATHER = {
    "type": "object",
    # A bounded city, so that even a model that knows nothing of tools ends its call in time.
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]  # fmt: skip
TOP_LOGPROBS = 5


@dataclass
class Check:
    name: str
    value: str
    ok: bool
    detail: str = ""


class Endpoint:
    """An OpenAI-compatible server at ``url``: its root (http://host:8000) or the base URL OpenAI clients
    take (http://host:8000/v1), either."""

    def __init__(self, url: str, api_key: str | None, timeout: float = 120.0) -> None:
        self.url, self.api_key, self.timeout = url.rstrip("/").removesuffix("/v1"), api_key, timeout

    def _req(self, path: str, body: dict | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except json.JSONDecodeError:
                return e.code, {}

    def model(self) -> str:
        status, body = self._req("/v1/models", None)
        if status != 200 or not body.get("data"):
            raise RuntimeError(f"GET /v1/models: {status} {body}")
        return body["data"][0]["id"]

    def chat(self, body: dict) -> tuple[int, dict]:
        return self._req("/v1/chat/completions", body)


def preflight(ep: Endpoint, model: str) -> list[Check]:
    """Invalid parameters must be refused with 400 before anything runs."""
    hi = [{"role": "user", "content": "hi"}]
    cases = {
        "temperature < 0 -> 400": {"temperature": -0.5},
        "top_p > 1 -> 400": {"top_p": 1.5},
        "n < 1 -> 400": {"n": 0},
        "unknown tool in tool_choice -> 400": {
            "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}},
    }  # fmt: skip
    checks = []
    for name, extra in cases.items():
        status, body = ep.chat({"model": model, "messages": hi, "max_tokens": 4, **extra})
        msg = (body.get("error") or {}).get("message", "")[:60]
        checks.append(Check(name, str(status), status == 400, msg))
    return checks


def agreed_tokens(golden: Golden, ids: list[int], served: list[bytes]) -> int:
    """Golden tokens before the first divergence, comparing each token's bytes (raw or as text)."""
    for k, i in enumerate(ids):
        if k >= len(served) or served[k] not in golden.token_keys[i]:
            return k
    return len(ids)


def _bytes(entry: dict) -> bytes:
    return bytes(entry["bytes"]) if entry.get("bytes") is not None else entry["token"].encode()


def topk_kl(golden_lp, top: list[dict], bytes_to_id: dict[bytes, int]) -> float | None:
    """KL(golden || served) over {served top-k tokens, rest} at one position (None if unmappable)."""
    ids = [bytes_to_id.get(_bytes(t)) for t in top]
    if not ids or any(i is None for i in ids) or len(set(ids)) != len(ids):
        return None
    p_served = [math.exp(t["logprob"]) for t in top]
    p_gold = [math.exp(golden_lp[i].item()) for i in ids]
    rest_s, rest_g = max(1e-9, 1 - sum(p_served)), max(1e-9, 1 - sum(p_gold))
    kl = sum(g * math.log(max(g, 1e-30) / max(s, 1e-30)) for g, s in zip(p_gold, p_served))
    return max(0.0, kl + rest_g * math.log(rest_g / rest_s))


def _divergence(golden: Golden, gold, gold_ids: list[int], content: list[dict], k: int) -> dict[str, Any]:
    """Where and how the replies part: the next tokens of each, and how far below the golden's top
    choice the golden put the served token (a near-tie when small, in nats)."""
    served_id = golden.bytes_to_id.get(_bytes(content[k])) if k < len(content) else None
    margin = None
    if served_id is not None and k < len(gold.logprobs):
        lp = gold.logprobs[k]
        margin = float(lp.max() - lp[served_id])
    return {
        "token": k, "golden": b"".join(golden.token_bytes[i] for i in gold_ids[k : k + 3]).decode(errors="replace"),
        "served": b"".join(_bytes(e) for e in content[k : k + 3]).decode(errors="replace"), "margin_nats": margin,
    }  # fmt: skip


def greedy_checks(ep: Endpoint, model: str, golden: Golden, max_tokens: int, min_agreement: float,
                  max_kl: float) -> tuple[list[Check], list[dict[str, Any]]]:  # fmt: skip
    rows, kls, agreed, total = [], [], 0, 0
    usage_ok, finish_ok, finish_n = 0, 0, 0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        gold = golden.greedy(messages, max_tokens)
        status, body = ep.chat({"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
                                "logprobs": True, "top_logprobs": TOP_LOGPROBS})  # fmt: skip
        if status != 200:
            rows.append({"prompt": prompt, "error": f"{status} {body}"})
            total += len(gold.ids)
            continue
        choice = body["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        gold_ids = list(gold.ids)
        if gold_ids and gold_ids[-1] in golden.eos and len(content) < len(gold_ids):
            gold_ids.pop()  # an endpoint that leaves the EOS token out of its logprobs
        k = agreed_tokens(golden, gold_ids, [_bytes(e) for e in content])
        full = k == len(gold_ids) == len(content)
        agreed, total = agreed + k, total + len(gold_ids)
        for pos in range(min(k + 1, len(content), len(gold.logprobs))):  # through the first divergence
            kl = topk_kl(gold.logprobs[pos], content[pos].get("top_logprobs") or [], golden.bytes_to_id)
            if kl is not None:
                kls.append(kl)
        prompt_tokens = (body.get("usage") or {}).get("prompt_tokens")
        usage_ok += prompt_tokens == len(gold.prompt_ids)
        if full:
            finish_n += 1
            finish_ok += choice.get("finish_reason") == gold.finish_reason
        rows.append({
            "prompt": prompt, "agreed": k, "golden_tokens": len(gold_ids), "identical": full,
            "first_divergence": None if full else _divergence(golden, gold, gold_ids, content, k),
            "prompt_tokens": [prompt_tokens, len(gold.prompt_ids)],
            "finish_reason": [choice.get("finish_reason"), gold.finish_reason],
        })  # fmt: skip
    agreement = agreed / total if total else 0.0
    mean_kl = sum(kls) / len(kls) if kls else float("nan")
    diverged = [r for r in rows if r.get("first_divergence")]
    first = min((r["first_divergence"]["token"] for r in diverged), default=None)
    checks = [
        Check("greedy agreement (tokens before first divergence)", f"{agreement:.1%}", agreement >= min_agreement,
              f"{sum(1 for r in rows if r.get('identical'))}/{len(rows)} identical"
              + (f"; earliest divergence at token {first}" if first is not None else "")),
        Check(f"KL(golden||served) from top-{TOP_LOGPROBS} logprobs", f"{mean_kl:.5f}",
              bool(kls) and mean_kl <= max_kl, f"{len(kls)} positions, max {max(kls, default=float('nan')):.4f}"),
        Check("usage.prompt_tokens exact", f"{usage_ok}/{len(PROMPTS)}", usage_ok == len(PROMPTS)),
        Check("finish_reason agrees (identical replies)", f"{finish_ok}/{finish_n}", finish_ok == finish_n),
    ]  # fmt: skip
    return checks, rows


def tool_check(ep: Endpoint, model: str) -> Check:
    """A named tool call must come back as a call whose arguments validate against its schema."""
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    status, body = ep.chat({"model": model, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 128,
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})  # fmt: skip
    if status != 200:
        return Check("tool call valid, finish_reason tool_calls", str(status), False, str(body)[:60])
    choice = body["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    try:
        [call] = calls
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        valid, why = True, call["function"]["arguments"][:60]
    except (ValueError, AssertionError, KeyError, jsonschema.ValidationError) as e:
        valid, why = False, f"{type(e).__name__}: {str(e)[:50]}"
    reason = choice.get("finish_reason")
    return Check("tool call valid, finish_reason tool_calls", f"{len(calls)} call(s), {reason}",
                 valid and reason == "tool_calls", why)  # fmt: skip


def render(checks: list[Check]) -> str:
    w = max(len(c.name) for c in checks)
    v = max(len(c.value) for c in checks)
    lines = [f"{'check':<{w}}  {'value':<{v}}  result  detail", "-" * (w + v + 24)]
    lines += [f"{c.name:<{w}}  {c.value:<{v}}  {'PASS' if c.ok else 'FAIL':<6}  {c.detail}" for c in checks]
    return "\n".join(lines)
