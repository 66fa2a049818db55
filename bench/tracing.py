"""What tracing costs: HTTP tokens/s and TTFT with export off, on at 10% and on at 100% sampling; and one
request's waterfall as a picture.

Three meshes of the compose file's topology (gateway, router, kvstore, prefill, decode; no speculator) on
the same model run side by side: one that traces nothing, two that export every service's spans over
OTLP/gRPC to a receiver in this process (a real TraceService server: the spans are encoded, sent and
decoded) at 10% and 100% of new traces. The rounds alternate between them (rotating the order), so the
machine's noise falls on all; each round streams ``--streams`` greedy completions of ``--max-tokens``
through the gateway's OpenAI HTTP API, every prompt unique to its round (no prefix-cache hits from an
earlier round), after the CPUs went idle. Reports medians, and each mode's against off: tokens/s, TTFT,
and the CPU time all the mesh's processes spent per token (span export included: the
round ends when the CPUs are idle again), which the machine's noise moves least.

With ``--baseline REF`` a fourth mesh runs the code of git REF (the commit before tracing existed), so
"off" is compared with what there was before as well.

Then one request through the 100% mesh with a traceparent of its own: its spans, from every service,
drawn on one time axis (``--png``).

    pip install -r bench/requirements.txt   # matplotlib, for the picture
    python bench/tracing.py --rounds 10 --baseline 39bcd3a --json bench/results/tracing.json \
        --png docs/images/trace_waterfall.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _common import write_json  # noqa: E402
from _idle_cpu import wait_for_idle_cpu  # noqa: E402
from _side_by_side import round_flags, running_mesh, unique  # noqa: E402
from _table import print_table  # noqa: E402
from engine import chat_prompts  # noqa: E402
from peers import http_round, model_id  # noqa: E402

from kvmesh.engine.default_model import default_model_path  # noqa: E402
from kvmesh.launcher.spec import MeshOptions  # noqa: E402
from kvmesh.runtime.otlp_receiver import OtlpReceiver, ReceivedSpan  # noqa: E402

MODES = {"off": None, "10%": 0.1, "100%": 1.0}
REPO = BENCH.parent
ROLES = ("gateway", "router", "kvstore", "prefill", "decode")


@contextlib.contextmanager
def checkout(ref: str, workdir: Path) -> Iterator[Path]:
    """``ref`` of this repository in a worktree of its own, for the duration."""
    path = workdir / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


@contextlib.contextmanager
def mesh(
    model: Path, ratio: float | None, endpoint: str, workdir: Path, code: Path | None = None
) -> Iterator[tuple[str, list[int]]]:
    """A mesh tracing ``ratio`` of requests (None: off), running ``code`` (a checkout; None: this one)."""
    traced = {} if ratio is None else {"KVMESH_OTLP_ENDPOINT": endpoint, "KVMESH_TRACE_SAMPLE_RATIO": str(ratio)}
    if code is not None:  # its packages before the installed ones, whatever the working directory
        traced = {**traced, "PYTHONPATH": str(code), "PYTHONSAFEPATH": "1"}
    opts = MeshOptions(
        model=model,
        speculator=False,
        publish=False,
        gateway_port=0,
        log_level="warning",
        # Never prefill on decode: every request takes the split path, KV hand-off included.
        role_env={
            **{role: traced for role in ROLES},
            "router": {**traced, "KVMESH_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0"},
        },
    )
    with running_mesh(opts, workdir, "tracing-") as (url, running, topology):
        yield url, [running.process(p.name).pid for p in topology.processes if p.role in ROLES]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes have used so far (each process's own threads included)."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return ticks / os.sysconf("SC_CLK_TCK")


def traced_request(url: str, served: str, prompt: list[int], receiver: OtlpReceiver) -> list[ReceivedSpan]:
    """One completion in a trace of its own; its spans once every service has sent them."""
    trace_id = secrets.token_hex(16)
    body = {"model": served, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
    )
    urllib.request.urlopen(request, timeout=120).read()
    services = {f"kvmesh-{r}" for r in ("gateway", "router", "prefill", "decode")}
    return receiver.wait_for(lambda spans: services <= {s.service for s in spans}, trace_id, timeout_s=30)


def draw_waterfall(spans: list[ReceivedSpan], path: Path) -> None:
    """The spans as bars on one time axis, children under their parents, coloured by service."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    children: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        children.setdefault(s.parent_span_id if s.parent_span_id in ids else "", []).append(s)
    ordered: list[tuple[int, ReceivedSpan]] = []

    def visit(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            ordered.append((depth, s))
            visit(s.span_id, depth + 1)

    visit("", 0)
    t0 = min(s.start_ns for s in spans)
    services = sorted({s.service for s in spans})
    colours = dict(zip(services, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(12, 0.32 * len(ordered) + 1.2))
    for row, (depth, s) in enumerate(ordered):
        start, width = (s.start_ns - t0) / 1e6, max((s.end_ns - s.start_ns) / 1e6, 0.05)
        ax.barh(row, width, left=start, color=colours[s.service], height=0.7)
        name = s.name.rsplit("/", 1)[-1] if "/" in s.name and " " not in s.name else s.name
        label = f"{'  ' * depth}{s.service.removeprefix('kvmesh-')}: {name}"
        ax.text(-0.01, row, label, ha="right", va="center", fontsize=8, transform=ax.get_yaxis_transform())
        ax.text(start + width, row, f" {width:.1f} ms", va="center", fontsize=7)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the gateway received the request")
    ax.set_title("One request through the split mesh (SmolLM2, 16 tokens): its spans from every service")
    fig.subplots_adjust(left=0.24, right=0.95)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    round_flags(parser)
    parser.add_argument("--png", type=Path, help="draw one request's waterfall here")
    parser.add_argument(
        "--baseline", metavar="REF", help="also run git REF's mesh (the code before tracing) as mode 'before'"
    )
    args = parser.parse_args()
    model = args.model or default_model_path()
    prompts = chat_prompts(model, args.streams)
    modes = [*MODES, *(["before"] if args.baseline else [])]
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    with (
        tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp,
        OtlpReceiver() as receiver,
        contextlib.ExitStack() as stack,
    ):
        code = {"before": stack.enter_context(checkout(args.baseline, Path(tmp)))} if args.baseline else {}
        meshes = {
            m: stack.enter_context(mesh(model, MODES.get(m), receiver.endpoint, Path(tmp), code.get(m))) for m in modes
        }
        urls = {m: url for m, (url, _) in meshes.items()}
        served = model_id(urls["off"])
        for m in modes:  # warm every mesh before anything is measured
            asyncio.run(http_round(urls[m], served, unique(prompts, 0), 8))
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for m in order:
                round_no = 1 + len(modes) * r + modes.index(m)
                wait_for_idle_cpu()  # the previous round's mesh has finished its own background work
                pids = meshes[m][1]
                cpu0 = cpu_seconds(pids)
                result = asyncio.run(http_round(urls[m], served, unique(prompts, round_no), args.max_tokens))
                wait_for_idle_cpu()  # what the round left behind (span export, kvstore puts) is its cost too
                result["cpu_ms_per_token"] = 1e3 * (cpu_seconds(pids) - cpu0) / sum(result["tokens"])
                samples[m].append(result)
                print(
                    f"round {r + 1} tracing {m}: {result['tokens_per_s']:.1f} tok/s, TTFT {result['ttft_s']:.3f} s, "
                    f"{result['cpu_ms_per_token']:.2f} CPU ms/token"
                )
        spans = traced_request(urls["100%"], served, unique(prompts, 999)[0], receiver)
        exported = len(receiver.spans())
    keys = ("tokens_per_s", "ttft_s", "cpu_ms_per_token")
    med = {m: {k: statistics.median(s[k] for s in samples[m]) for k in keys} for m in modes}
    # Each mode against off: +x% is x% more (of tokens/s: faster; of TTFT and CPU: slower, dearer).
    vs_off = {m: {k: med[m][k] / med["off"][k] - 1 for k in keys} for m in modes}
    rows = [
        [
            f"tracing {m}",
            f"{med[m]['tokens_per_s']:.1f}",
            f"{100 * vs_off[m]['tokens_per_s']:+.1f}%",
            f"{med[m]['ttft_s']:.3f}",
            f"{100 * vs_off[m]['ttft_s']:+.1f}%",
            f"{med[m]['cpu_ms_per_token']:.2f}",
            f"{100 * vs_off[m]['cpu_ms_per_token']:+.1f}%",
        ]
        for m in modes
    ]
    print_table(
        [
            f"{args.streams} streams x {args.max_tokens} tokens",
            "tok/s (median)",
            "vs off",
            "TTFT s (median)",
            "vs off",
            "mesh CPU ms/token",
            "vs off",
        ],
        rows,
    )
    print(f"spans received: {exported}; the traced request's: {len(spans)} from {sorted({s.service for s in spans})}")
    if args.png:
        draw_waterfall(spans, args.png)
        print(f"wrote {args.png}")
    write_json(
        args.json,
        {
            "model": str(model),
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "samples": {m: [{k: s[k] for k in keys} for s in samples[m]] for m in modes},
            "medians": med,
            "vs_off": vs_off,
            "baseline": args.baseline,
            "spans_received": exported,
            "waterfall": [
                {"service": s.service, "name": s.name, "start_ns": s.start_ns, "end_ns": s.end_ns} for s in spans
            ],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
