"""The same workload through the three chat APIs: chat completions (the anchor), the Responses API and
Anthropic's Messages, on one mesh.

Each round streams ``--streams`` greedy chats of ``--max-tokens`` at once through one API (the
default model's 16 questions, each marked with its round so no round reads an earlier one's prefix from
cache); the APIs alternate, rotating the order each round, after the CPUs went idle. The three build the
same prompt through the same chat template and run the same greedy tokens, so any difference is the API
layer's: parsing, translating, rendering events. Reports medians of tokens/s and mean TTFT per round,
each API against chat completions (goal: within 3%).

    python bench/api.py --rounds 6 --json bench/results/api.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _common import write_json  # noqa: E402
from _idle_cpu import wait_for_idle_cpu  # noqa: E402
from _side_by_side import round_flags, running_mesh  # noqa: E402
from _table import print_table  # noqa: E402
from engine import QUESTIONS  # noqa: E402
from peers import model_id  # noqa: E402

from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.launcher.spec import MeshOptions  # noqa: E402

ANCHOR = "chat completions"


def chat_body(model: str, question: str, max_tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": question}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}


def responses_body(model: str, question: str, max_tokens: int) -> tuple[str, dict]:
    body = {"model": model, "input": question, "max_output_tokens": max_tokens, "temperature": 0, "stream": True}
    return "/v1/responses", body | {"store": False}


def messages_body(model: str, question: str, max_tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": question}]
    return "/v1/messages", {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0} | {
        "stream": True
    }


def chat_event(data: dict) -> tuple[bool, int | None]:
    """(this event carries text, the output tokens if it says)."""
    usage = data.get("usage") or {}
    text = any((c.get("delta") or {}).get("content") for c in data.get("choices") or [])
    return text, usage.get("completion_tokens")


def responses_event(data: dict) -> tuple[bool, int | None]:
    kind = data.get("type")
    if kind in ("response.completed", "response.incomplete"):
        return False, data["response"]["usage"]["output_tokens"]
    return kind == "response.output_text.delta" and bool(data.get("delta")), None


def messages_event(data: dict) -> tuple[bool, int | None]:
    if data.get("type") == "message_delta":
        return False, data["usage"]["output_tokens"]
    return data.get("type") == "content_block_delta" and bool(data["delta"].get("text")), None


APIS: dict[str, tuple[Callable[..., tuple[str, dict]], Callable[[dict], tuple[bool, int | None]]]] = {
    ANCHOR: (chat_body, chat_event),
    "responses": (responses_body, responses_event),
    "messages": (messages_body, messages_event),
}


async def stream_one(session, url: str, api: str, model: str, question: str, max_tokens: int) -> dict:
    make_body, read_event = APIS[api]
    path, body = make_body(model, question, max_tokens)
    t0 = time.perf_counter()
    ttft, tokens = None, None
    async with session.post(url + path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{api}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            text, counted = read_event(json.loads(line[5:]))
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            tokens = counted if counted is not None else tokens
    if tokens is None:
        raise RuntimeError(f"{api}: the stream never said how many tokens it sent")
    return {"ttft_s": ttft, "tokens": tokens}


async def api_round(url: str, api: str, model: str, questions: list[str], max_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_one(session, url, api, model, q, max_tokens) for q in questions))
        wall = time.perf_counter() - t0
    ttfts = [s["ttft_s"] for s in streams if s["ttft_s"] is not None]
    return {
        "tokens_per_s": sum(s["tokens"] for s in streams) / wall,
        "ttft_s": sum(ttfts) / len(ttfts),
        "tokens": [s["tokens"] for s in streams],
    }


def questions(n: int, round_no: int) -> list[str]:
    """``n`` questions marked with the round: nothing of an earlier round's prompt is cached."""
    return [f"[{round_no}] {q}" for q in (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    round_flags(parser)
    args = parser.parse_args()
    model = args.model or default_model_path()
    samples: dict[str, list[dict]] = {api: [] for api in APIS}
    apis = list(APIS)
    opts = MeshOptions(model=model, speculator=False, publish=False, gateway_port=0, log_level="warning")
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp, running_mesh(opts, Path(tmp), "api-") as mesh:
        url = mesh[0]
        served = model_id(url)
        for api in apis:  # warm-up: every path compiled and every route's first call made
            asyncio.run(api_round(url, api, served, questions(args.streams, 0), 8))
        for r in range(args.rounds):
            for api in apis[r % len(apis) :] + apis[: r % len(apis)]:
                wait_for_idle_cpu()
                round_no = 1 + len(apis) * r + apis.index(api)
                result = asyncio.run(api_round(url, api, served, questions(args.streams, round_no), args.max_tokens))
                samples[api].append(result)
                print(f"round {r + 1} {api}: {result['tokens_per_s']:.1f} tok/s, TTFT {result['ttft_s']:.3f} s")
    medians = {
        api: {
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in runs),
            "ttft_s": statistics.median(s["ttft_s"] for s in runs),
            "tokens_per_stream": statistics.median(t for s in runs for t in s["tokens"]),
        }
        for api, runs in samples.items()
    }
    anchor = medians[ANCHOR]
    rows = [
        [
            api,
            f"{m['tokens_per_s']:.1f}",
            f"{m['tokens_per_s'] / anchor['tokens_per_s']:.3f}",
            f"{m['ttft_s'] * 1e3:.0f}",
            f"{m['ttft_s'] / anchor['ttft_s']:.3f}",
            f"{m['tokens_per_stream']:.0f}",
        ]
        for api, m in medians.items()
    ]
    print(f"\n{args.streams} streams x {args.max_tokens} greedy tokens, medians of {args.rounds} rounds")
    print_table(["API", "tok/s", "vs chat", "TTFT ms", "vs chat", "tokens/stream"], rows)
    write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "medians": medians, "runs": samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
