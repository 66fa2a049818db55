"""The mesh on a GPU: a prefill and a decode worker sharing the one GPU, the KV hand-off over NIXL
(VRAM to VRAM) and over gRPC, concurrent streams through the gateway's OpenAI HTTP API.

Part 3 of bench/gpu_check.sh. The model is written here: transformers' random init in SmolLM2-135M's
shape with a 4096-token vocabulary (a BPE tokenizer trained here on Python's own sources; the
tokenizer must cover the vocabulary the gateway detokenizes). The router is told never to prefill
on decode, so every request crosses the hand-off. For each transport, one mesh: 16 greedy
completions at once, then from the workers' and gateway's metrics the blocks and bytes pulled,
the time the hand-offs took (the gateway's ``kv_transfer`` phase) and any failed transfer.
The two transports must give the same tokens (greedy; bytes that arrived wrong would show).

``--dry-run``: the same on the CPU with a tiny model and 4 streams (tests/bench/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
import traceback
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _side_by_side import running_mesh  # noqa: E402
from _table import print_table  # noqa: E402
from gpu_engine import DRY_SHAPES, SHAPES, write_model  # noqa: E402

from kvmesh.launcher.scrape import scrape  # noqa: E402
from kvmesh.launcher.spec import MeshOptions  # noqa: E402
from kvmesh.models.bpe import train_tokenizer, write_tokenizer  # noqa: E402
from kvmesh.runtime.ports import free_port  # noqa: E402

TRANSPORTS = ("nixl", "grpc")


@dataclass(frozen=True)
class Plan:
    device: str
    shape: dict[str, Any]
    streams: int = 16
    prompt_len: int = 512
    max_tokens: int = 64
    corpus_bytes: int = 2_000_000

    @classmethod
    def dry(cls) -> Plan:
        return cls("cpu", {**DRY_SHAPES["tiny"], "vocab_size": 512}, 4, 40, 8, 200_000)


def write_mesh_model(path: Path, plan: Plan) -> None:
    """The checkpoint and a tokenizer trained to exactly its vocabulary."""
    write_model(path, plan.shape)
    write_tokenizer(train_tokenizer(plan.shape["vocab_size"], corpus_bytes=plan.corpus_bytes), path)


def options(model: Path, plan: Plan, transport: str) -> MeshOptions:
    worker = {"KVMESH_KV_TRANSPORT": transport, "KVMESH_NUM_BLOCKS": "512"}
    if plan.device == "cpu":  # dynamo cannot trace Triton's interpreter: a dry run's workers step eager
        worker["KVMESH_COMPILE"] = "0"
    return MeshOptions(
        model=model,
        prefill=1,
        decode=1,
        speculator=False,
        gateway_port=0,
        publish=False,
        device_prefill=plan.device,
        device_decode=plan.device,
        role_env={
            "router": {"KVMESH_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0", "KVMESH_LOCAL_PREFILL_MIN_HIT_FRACTION": "2"},
            "prefill": worker,
            "decode": worker,
            "gateway": {"KVMESH_HTTP_PORT": str(free_port())},
        },
    )


def complete(url: str, prompt: list[int], max_tokens: int) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)["choices"][0]["text"]


def run_transport(workdir: Path, model: Path, plan: Plan, transport: str, prompts: list[list[int]]) -> dict[str, Any]:
    with running_mesh(options(model, plan, transport), workdir, f"{transport}-") as (url, mesh, _):
        complete(url, prompts[0][:8], 2)  # warm-up: the first step of each worker
        before = scrape(mesh.topology.get("decode-0"))
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda p: complete(url, p, plan.max_tokens), prompts))
        seconds = time.perf_counter() - t0
        decode, gateway = scrape(mesh.topology.get("decode-0")), scrape(mesh.topology.get("gateway"))
    pulled = decode["kvmesh_decode_bytes_pulled_total"] - before["kvmesh_decode_bytes_pulled_total"]
    transfer_s = gateway.get("kvmesh_gateway_request_phase_seconds_sum{phase=kv_transfer}", 0.0)
    return {
        "transport": transport,
        "streams": len(prompts),
        "tokens_per_s": len(prompts) * plan.max_tokens / seconds,
        "seconds": seconds,
        "remote_prefills": decode["kvmesh_decode_remote_prefills_total"]
        - before["kvmesh_decode_remote_prefills_total"],
        "blocks_pulled": decode["kvmesh_decode_blocks_pulled_total"] - before["kvmesh_decode_blocks_pulled_total"],
        "bytes_pulled": pulled,
        "transfer_failures": decode["kvmesh_decode_transfer_failures_total"],
        "kv_transfer_seconds": transfer_s,
        "handoff_bytes_per_s": pulled / transfer_s if transfer_s else None,
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, 4 streams")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_mesh: no CUDA device here; --dry-run runs the same code on the CPU", file=sys.stderr)
        return 2
    plan = Plan.dry() if args.dry_run else Plan("cuda:0", {**SHAPES["smollm2-135m"], "vocab_size": 4096})
    started = time.monotonic()
    runs, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        write_mesh_model(model, plan)
        g = torch.Generator().manual_seed(0)
        vocab = plan.shape["vocab_size"]
        prompts = [torch.randint(300, vocab, (plan.prompt_len + i,), generator=g).tolist() for i in range(plan.streams)]
        for transport in TRANSPORTS:
            print(f"\n== mesh on {plan.device}, KV over {transport}", flush=True)
            try:
                runs.append(run_transport(Path(tmp), model, plan, transport, prompts))
            except Exception:
                errors.append(f"{transport}: {traceback.format_exc(limit=8)}")
                print(f"  ERROR:\n{traceback.format_exc(limit=8)}", flush=True)
    same = len(runs) == 2 and runs[0]["outputs"] == runs[1]["outputs"]
    checks = {
        "every request handed off": all(r["remote_prefills"] == r["streams"] for r in runs),
        "no failed transfer": all(r["transfer_failures"] == 0 for r in runs),
        "nixl and grpc give the same text": same,
    }
    passed = not errors and len(runs) == 2 and all(checks.values())
    report = {"device": plan.device, "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
              "checks": checks, "errors": errors, "passed": passed}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print_table(["transport", "streams", "tok/s", "hand-offs", "blocks", "MB pulled", "hand-off MB/s", "failures"],
                [[r["transport"], str(r["streams"]), f"{r['tokens_per_s']:.0f}", f"{r['remote_prefills']:.0f}",
                  f"{r['blocks_pulled']:.0f}", f"{r['bytes_pulled'] / 1e6:.1f}",
                  f"{r['handoff_bytes_per_s'] / 1e6:.1f}" if r["handoff_bytes_per_s"] else "n/a",
                  f"{r['transfer_failures']:.0f}"] for r in runs])  # fmt: skip
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"\n{'PASSED' if passed else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
