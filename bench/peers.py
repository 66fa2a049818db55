"""kvmesh side by side with vLLM and llama.cpp: same machine, same model, same workload, in-process and over HTTP.

Workload (every engine): SmolLM2-135M-Instruct (kvmesh's default model), the 16 chat-templated questions of
bench/engine.py (35-43 prompt tokens with the model's template) x 128 greedy new tokens, EOS ignored. Rows:
kvmesh fp32/bf16/int8 weights, vLLM fp32/bf16, llama.cpp F32/BF16/Q8_0 GGUFs and its Q4_1 GGUF. Columns:
  - in-process, 16 at once: tok/s over the whole call (prefill included) with all 16 prompts submitted together;
  - in-process, 1 alone: the first prompt by itself;
  - HTTP, 16 concurrent streams: each engine's OpenAI server, streaming ``/v1/completions`` with the prompt as
    token ids (all three servers accept them), ``max_tokens``, ``temperature=0``, ``ignore_eos: true``; tok/s =
    streamed tokens (the usage chunk where the server sends one, else one per chunk) / wall time from sending the
    first request to the end of the last stream; mean time to first token;
  - HTTP, 1 stream.
What "in-process" means per engine: kvmesh: ``LLMEngine.generate`` (bench/engine.py's ``make_engine``/``run_kvmesh``,
no prefix cache); vLLM: ``LLM.generate`` on token-id prompts with ``SamplingParams(temperature=0, max_tokens=128,
ignore_eos=True)``, no prefix caching; llama.cpp: the same batched greedy loop llama-server runs (all prompts
as sequences of one llama_batch, one llama_decode per step), called through the sdist's ctypes binding against
the libllama built here, KV cleared before every call (bench/_peers_inproc_llamacpp.py). Each runs in its own
interpreter (its venv) behind a small stdin/fd protocol (bench/_peers_worker.py). The HTTP servers: kvmesh's whole
mesh as ``kvmesh up --no-speculator`` starts it (colocated on this machine: redis, router, kvstore, prefill,
decode, gateway), the workers' dtype set by KVMESH_DTYPE; vLLM's ``python -m vllm.entrypoints.openai.api_server``;
native ``llama-server -np 16``. Servers keep their own defaults otherwise (all three reuse cached prompt prefixes
across repeats; the prompts are ~5% of the work); in-process nothing is cached.

Order: per precision, every engine is started (and warmed up with one full round that is not counted), then the
engines alternate A B C A B C ... for ``--repeats`` rounds; the table shows medians. Every engine uses 2 threads.
Every measured call waits first until the CPUs are idle (bench/_idle_cpu.py): an engine still busy after its
call returned would otherwise slow whichever engine runs next.
Peers are installed on first use into their own venvs under ``--peers-dir`` (bench/_peers_install.py); their
servers bind 127.0.0.1 on free ports and are stopped in any case (process groups; also on Ctrl-C / SIGTERM).

Run (not part of ``make test``; about 25 minutes, plus ~20 for the first install):
``flock /tmp/kvmesh-bench.lock python bench/peers.py [--repeats 3] [--engines kvmesh,vllm,llamacpp]
[--precisions fp32,bf16,int8,q4_1] [--quick] [--peers-dir DIR] [--json bench/results/peers.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))
import _peers_install as install  # noqa: E402
from _idle_cpu import wait_for_idle_cpu  # noqa: E402
from _peers_report import ENGINES, PRECISIONS, ROWS, Sample, agreement, medians, ratios, table_rows  # noqa: E402
from _table import print_table  # noqa: E402
from engine import chat_prompts  # noqa: E402

THREADS = 2
KVMESH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "int8": "bfloat16"}
# precision -> --quantization, LM head included (none for the others): like llama.cpp's Q8_0, which quantizes every
# matrix, the tied embedding / LM head too.
KVMESH_QUANTIZATION = {"int8": "int8"}
VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
GGUF = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "q4_1": "Q4_1"}
# llama.cpp's repacked (AMX) kernels for quantized GGUFs die on these machines (Q4_1: SIGILL, Q8_0: SIGSEGV while
# loading): those rows run with weight repacking off.
LLAMACPP_NO_REPACK = ("int8", "q4_1")
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
READY_TIMEOUT_S = 900  # a vLLM start compiles for ~2.5 min on 2 cores


class Interrupted(Exception):
    """SIGTERM, turned into an exception so every ``finally`` stops what it started."""


def _on_sigterm(*_: object) -> None:
    raise Interrupted


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process's group (vLLM and the mesh spawn children), SIGKILL what is left after the grace."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Worker:
    """An in-process engine in its own interpreter: start, then ``run`` requests (bench/_peers_worker.py's protocol)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        read_fd, write_fd = os.pipe()
        self.name = name
        self.log = log
        with log.open("a") as f:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
                env={**env, "PEERS_RESULT_FD": str(write_fd)},
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        os.close(write_fd)
        self.results = os.fdopen(read_fd)
        if json.loads(self._line()) != {"ready": True}:
            raise RuntimeError(f"{name}: unexpected first line; see {log}")

    def _line(self) -> str:
        line = self.results.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (rc={self.proc.poll()}); see {self.log}")
        return line

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._line())
        return reply["seconds"], reply["tokens"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        stop_group(self.proc, grace_s=10.0)
        self.results.close()


# -- starting each engine --------------------------------------------------------------------------------


class Peers:
    """What is installed, where logs go, and how each engine x precision starts (in-process worker, HTTP server)."""

    def __init__(self, args: argparse.Namespace, model: Path, logs: Path, max_prompt: int) -> None:
        self.args, self.model, self.logs, self.max_prompt = args, model, logs, max_prompt
        self.inst = install.Installer(Path(args.peers_dir).expanduser())
        self.vllm = install.install_vllm(self.inst) if "vllm" in args.engines else None
        self.llamacpp = install.install_llamacpp(self.inst, model) if "llamacpp" in args.engines else None

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @contextlib.contextmanager
    def inproc(self, engine: str, precision: str) -> Iterator[Worker]:
        name = f"{engine}-{precision}-inproc"
        if engine == "kvmesh":
            argv = [
                sys.executable,
                str(BENCH / "_peers_inproc_kvmesh.py"),
                str(self.model),
                KVMESH_DTYPE[precision],
                str(int(self.args.kvmesh_compile)),
                KVMESH_QUANTIZATION.get(precision, "none"),
            ]
            env = {**os.environ, "PYTHONPATH": str(REPO)}
        elif engine == "vllm":
            argv = [str(self.vllm.python), str(BENCH / "_peers_inproc_vllm.py"), str(self.model), VLLM_DTYPE[precision]]
            env = {**os.environ, **VLLM_ENV}
            env.pop("PYTHONPATH", None)
        else:
            gguf = self.llamacpp.ggufs[GGUF[precision]]
            argv = [
                str(self.llamacpp.python),
                str(BENCH / "_peers_inproc_llamacpp.py"),
                str(gguf),
                str(THREADS),
                str(self.ctx_size()),
                "0" if precision in LLAMACPP_NO_REPACK else "1",
            ]
            env = install.llamacpp_env(self.llamacpp)
        worker = Worker(name, argv, env, self.log(name))
        try:
            yield worker
        finally:
            worker.close()

    def ctx_size(self) -> int:
        """Room for every request's prompt and new tokens at once, a multiple of 256 per slot (16 x 256 here)."""
        per_slot = -(-(self.max_prompt + self.args.new_tokens) // 256) * 256
        return self.args.requests * per_slot

    @contextlib.contextmanager
    def server(self, engine: str, precision: str) -> Iterator[str]:
        """The engine's OpenAI server, ready; yields its base URL."""
        if engine == "kvmesh":
            with self._mesh(precision) as url:
                yield url
            return
        port = free_port()
        name = f"{engine}-{precision}-http"
        if engine == "vllm":
            argv = [
                str(self.vllm.python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(self.model),
                "--dtype",
                VLLM_DTYPE[precision],
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--seed",
                "0",
            ]
            env = {**os.environ, **VLLM_ENV}
            env.pop("PYTHONPATH", None)
        else:
            argv = [
                str(self.llamacpp.bin_dir / "llama-server"),
                "-m",
                str(self.llamacpp.ggufs[GGUF[precision]]),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-np",
                str(self.args.requests),
                "-t",
                str(THREADS),
                "-tb",
                str(THREADS),
                "-c",
                str(self.ctx_size()),
            ]
            if precision in LLAMACPP_NO_REPACK:
                argv.append("--no-repack")
            env = {**os.environ, "LD_LIBRARY_PATH": str(self.llamacpp.bin_dir)}
        with self.log(name).open("a") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, self.log(name))
            yield url
        finally:
            stop_group(proc)

    @contextlib.contextmanager
    def _mesh(self, precision: str) -> Iterator[str]:
        from kvmesh.launcher.spec import MeshOptions
        from kvmesh.launcher.supervisor import Mesh
        from kvmesh.launcher.topology import build_topology

        dtype = {"KVMESH_DTYPE": KVMESH_DTYPE[precision]}
        if precision in KVMESH_QUANTIZATION:
            dtype.update(KVMESH_QUANTIZATION=KVMESH_QUANTIZATION[precision], KVMESH_QUANTIZE_LM_HEAD="1")
        # Only decode runs decode steps: a compiling prefill worker would only start slower.
        decode = {**dtype, "KVMESH_COMPILE": str(int(self.args.kvmesh_compile))}
        # As `kvmesh up --no-speculator --no-publish` starts it: the compose file's mesh, free ports, this dtype.
        opts = MeshOptions(
            model=self.model,
            speculator=False,
            publish=False,
            gateway_port=0,
            log_level="warning",
            role_env={"prefill": dtype, "decode": decode},
            python=sys.executable,
        )
        run_dir = Path(tempfile.mkdtemp(prefix=f"peers-mesh-{precision}-", dir=self.logs))
        topology = build_topology(opts, run_dir)
        gateway = topology.get("gateway")
        mesh = Mesh(topology, run_dir)
        mesh.start()
        try:
            url = f"http://127.0.0.1:{gateway.env['KVMESH_HTTP_PORT']}"
            wait_ready(url, None, run_dir / "logs")
            yield url
        finally:
            mesh.stop()


def wait_ready(url: str, proc: subprocess.Popen | None, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited (rc={proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url}: not ready after {READY_TIMEOUT_S} s; see {log}")


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


# -- HTTP client ------------------------------------------------------------------------------------------


async def stream_one(session, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streaming /v1/completions request: time to first token, total time, tokens streamed."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if msg.get("usage"):
                usage = msg["usage"].get("completion_tokens")
            if any(c.get("text") for c in msg.get("choices") or []):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "seconds": time.perf_counter() - t0, "tokens": usage if usage is not None else chunks}


async def http_round(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_one(session, url, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in streams)
    ttfts = [s["ttft_s"] for s in streams if s["ttft_s"] is not None]
    return {
        "tokens_per_s": tokens / wall,
        "ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "tokens": [s["tokens"] for s in streams],
    }


# -- the rounds -------------------------------------------------------------------------------------------


def run_precision(
    peers: Peers, precision: str, prompts: list[list[int]], args, samples: list[Sample], outputs: dict, short: list[str]
) -> None:
    engines = [e for e in args.engines if precision in ROWS[e]]
    n = args.new_tokens
    with contextlib.ExitStack() as stack:
        workers = {}
        for e in engines:
            print(f"  starting {e} {precision} in-process ...", flush=True)
            workers[e] = stack.enter_context(peers.inproc(e, precision))
        for r in range(args.repeats + 1):  # round 0: the warm-up
            for e in engines:
                w16 = wait_for_idle_cpu()
                s16, out16 = workers[e].run(prompts, n)
                w1 = wait_for_idle_cpu()
                s1, out1 = workers[e].run(prompts[:1], n)
                if r == 0:
                    continue
                samples += [
                    Sample(e, precision, "inproc_16", len(prompts) * n / s16),
                    Sample(e, precision, "inproc_1", n / s1),
                ]
                outputs.setdefault((e, precision), out16)
                print(
                    f"  round {r} {e:9s} {precision}: in-process 16 {len(prompts) * n / s16:7.1f} tok/s, "
                    f"1 alone {n / s1:6.1f} tok/s (waited {w16:.1f} / {w1:.1f} s for idle CPUs)",
                    flush=True,
                )
    with contextlib.ExitStack() as stack:
        urls = {}
        for e in engines:
            print(f"  starting {e} {precision} HTTP server ...", flush=True)
            urls[e] = stack.enter_context(peers.server(e, precision))
        ids = {e: model_id(u) for e, u in urls.items()}
        for r in range(args.repeats + 1):
            for e in engines:
                w16 = wait_for_idle_cpu()
                h16 = asyncio.run(http_round(urls[e], ids[e], prompts, n))
                w1 = wait_for_idle_cpu()
                h1 = asyncio.run(http_round(urls[e], ids[e], prompts[:1], n))
                if any(t != n for t in h16["tokens"] + h1["tokens"]):
                    short.append(
                        f"{e} {precision} round {r}: streamed {h16['tokens']} / {h1['tokens']} tokens, not {n}"
                    )
                if r == 0:
                    continue
                samples += [
                    Sample(e, precision, "http_16", h16["tokens_per_s"], h16["ttft_s"]),
                    Sample(e, precision, "http_1", h1["tokens_per_s"], h1["ttft_s"]),
                ]
                print(
                    f"  round {r} {e:9s} {precision}: HTTP 16 {h16['tokens_per_s']:7.1f} tok/s "
                    f"(TTFT {h16['ttft_s']:.2f} s), 1 stream {h1['tokens_per_s']:6.1f} tok/s "
                    f"(waited {w16:.1f} / {w1:.1f} s for idle CPUs)",
                    flush=True,
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--peers-dir", default=str(install.default_peers_dir()), help="where the peers' venvs, builds and GGUFs go"
    )
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of %(default)s")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated subset of %(default)s")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds (medians); one warm-up round more")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="a trial: 16 new tokens, 1 repeat")
    ap.add_argument(
        "--kvmesh-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kvmesh with its compiled decode step (--compile), in-process and in the mesh's workers",
    )
    ap.add_argument("--json", default="bench/results/peers.json")
    args = ap.parse_args()
    args.engines = [e for e in args.engines.split(",") if e]
    args.precisions = [p for p in args.precisions.split(",") if p]
    if bad := set(args.engines) - set(ENGINES) or set(args.precisions) - set(PRECISIONS):
        ap.error(f"unknown: {sorted(bad)}")
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up in a log as they happen

    from kvmesh.engine.default_model import default_model_path

    model = default_model_path()
    prompts = chat_prompts(model, args.requests)
    t_install = time.perf_counter()
    logs = Path(args.peers_dir).expanduser() / "logs" / time.strftime("run-%Y%m%dT%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    peers = Peers(args, model, logs, max(map(len, prompts)))
    install_s = time.perf_counter() - t_install
    print(f"peers ready in {install_s:.0f} s; logs in {logs}")
    print(
        f"workload: {model.name}, {len(prompts)} chat prompts of "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"x {args.new_tokens} greedy tokens (EOS ignored), {THREADS} threads, {args.repeats} repeats (medians)"
    )
    samples: list[Sample] = []
    outputs: dict = {}
    short: list[str] = []
    t_run = time.perf_counter()
    for p in args.precisions:
        run_precision(peers, p, prompts, args, samples, outputs, short)
    run_s = time.perf_counter() - t_run

    table = medians(samples)
    rat = ratios(table)
    agree = {
        f"{e} {p} vs kvmesh {p}": agreement(outputs[("kvmesh", p)], outputs[(e, p)])
        for (e, p) in outputs
        if e != "kvmesh" and ("kvmesh", p) in outputs
    }
    print()
    print_table(
        [
            "engine",
            "precision",
            "in-process 16 tok/s",
            "in-process 1 tok/s",
            "HTTP 16 tok/s (mean TTFT)",
            "HTTP 1 tok/s",
        ],
        table_rows(table),
    )
    print()
    print_table(["ratio", "value"], [[k, "-" if v is None else f"{v:.2f}x"] for k, v in rat.items()])
    print(
        "\ngreedy output identical to kvmesh's (in-process, 16 sequences): "
        + ", ".join(f"{k}: {v}" for k, v in agree.items())
    )
    for line in short:
        print(f"warning: {line}")
    print(f"install/check {install_s:.0f} s, measured run {run_s:.0f} s")
    payload = {
        "workload": {
            "model": str(model),
            "requests": len(prompts),
            "prompt_lens": [min(map(len, prompts)), max(map(len, prompts))],
            "new_tokens": args.new_tokens,
            "threads": THREADS,
            "repeats": args.repeats,
            "kvmesh_compile": args.kvmesh_compile,
        },
        "versions": {"vllm": install.VLLM, "torch (vLLM venv)": install.TORCH, "llama.cpp": install.LLAMA_CPP_PYTHON},
        "medians": [{"engine": e, "precision": p, "column": c, **v} for (e, p, c), v in table.items()],
        "samples": [asdict(s) for s in samples],
        "ratios": rat,
        "agreement": agree,
        "warnings": short,
        "seconds": {"install": install_s, "run": run_s},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, Interrupted):
        print("interrupted: everything started was stopped", file=sys.stderr)
        sys.exit(130)
