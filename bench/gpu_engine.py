"""The engine on a GPU: greedy output against transformers, then decode tokens/s against the roofline.

Part 2 of bench/gpu_check.sh. Models are written here by transformers (random init, in the real
shapes: SmolLM2-135M's and a ~1.2B Llama's; no checkpoint travels to the GPU machine), with a wide
init so random logits are peaked and greedy comparisons are not decided by float rounding.

1. Correctness, float32 (TF32 off): 4 prompts x 32 greedy tokens, kvmesh's engine vs transformers
   ``generate`` on the same weights and device: sequences identical, and where not, the first
   position they part.
2. Speed, bfloat16: decode tokens/s with 1, 16 and 64 sequences in flight (128-token prompts;
   decode time = a run of N new tokens minus a run of 1, so prefill is not counted), eager and
   with ``--compile`` (the engine's fastest step mode today), against the step's floor measured
   in the same run: every weight read once at the measured copy bandwidth, or the step's matmul
   FLOPs at the measured bf16 matmul rate, whichever is larger. ``deterministic`` is a third mode:
   the batch-invariant Triton kernels of ``--deterministic`` (its cost against eager).
3. Deterministic serving, bfloat16, the first shape: one request's token ids and logprobs alone and
   inside a batch of 16 mixed-length requests, bit for bit.

``--dry-run``: the same code on the CPU with a tiny model and few tokens (float32 only), so the
script cannot rot between GPU runs (tests/bench/test_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _table import print_table  # noqa: E402
from kernels_gpu import guarded  # noqa: E402

_LLAMA = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "initializer_range": 0.1}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
                     "rope_theta": 100000.0, **_LLAMA},
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
                 "rope_theta": 500000.0, **_LLAMA},
}  # fmt: skip
DRY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True, "rope_theta": 10000.0,
             **_LLAMA},
}  # fmt: skip


@dataclass
class Plan:
    device: str
    shapes: dict[str, dict[str, Any]]
    check_prompts: int = 4
    check_tokens: int = 32
    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 128
    new_tokens: int = 128
    dtypes: tuple[str, ...] = ("bfloat16",)
    modes: tuple[str, ...] = ("eager", "compile", "deterministic")
    determinism_batch: int = 16

    @classmethod
    def dry(cls) -> Plan:
        # Three rows, not 16: the interpreter runs each --deterministic attention row as its own decode. The
        # speed section times eager only (a deterministic engine is built and run by the check above), four
        # tokens: a dry run checks that the code runs, its speeds are the interpreter's.
        return cls("cpu", DRY_SHAPES, 2, 8, (1, 4), 16, 4, ("float32",), ("eager",), 3)


@dataclass
class Report:
    device: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    determinism: list[dict[str, Any]] = field(default_factory=list)
    speeds: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            not self.errors
            and all(c["identical"] == c["prompts"] for c in self.checks)
            and all(d["bitwise"] for d in self.determinism)
        )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(report: Report, device: str, dry: bool) -> None:
    n = (1 << 20) if dry else (1 << 29)  # elements of bf16: 2 MiB on a dry run, 1 GiB on a GPU
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    report.ceilings["copy_GBps"] = 2 * src.numel() * 2 / _timed(lambda: dst.copy_(src), device) / 1e9
    m = 512 if dry else 8192
    a, b = (torch.randn(m, m, device=device, dtype=torch.bfloat16) for _ in range(2))
    report.ceilings["matmul_bf16_TFLOPs"] = 2 * m**3 / _timed(lambda: a @ b, device) / 1e12
    c = report.ceilings
    print(f"  copy {c['copy_GBps']:.1f} GB/s, bf16 matmul {c['matmul_bf16_TFLOPs']:.2f} TFLOP/s")


def write_model(path: Path, shape: dict[str, Any]) -> int:
    """A random-init Llama in ``shape`` saved by transformers (bfloat16); its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)).eval()
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(path)
    return params


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 7 * i,), generator=g).tolist() for i in range(count)]


def make_engine(path: Path, device: str, dtype: str, mode: str, max_seqs: int, prompt_len: int):
    """An engine whose steps run ``mode``: eager, compile or deterministic."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine

    blocks = max_seqs * (prompt_len + 256) // 16 + 64
    config = EngineConfig(device=device, dtype=dtype, num_blocks=blocks, max_num_seqs=max_seqs,
                          max_num_batched_tokens=max(2048, prompt_len), enable_prefix_cache=False,
                          compile=mode == "compile", deterministic=mode == "deterministic")  # fmt: skip
    return LLMEngine(path, config)


def greedy(engine, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    from kvmesh.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(batch, params)]


def transformers_greedy(path: Path, device: str, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = []
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p], device=device)
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            out.append(seq[0, len(p) :].tolist())
    del model
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_greedy(report: Report, plan: Plan, name: str, path: Path, vocab: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batch = prompts(vocab, plan.check_prompts, 16, seed=1)
    engine = make_engine(path, plan.device, "float32", "eager", plan.check_prompts, 64)
    ours = greedy(engine, batch, plan.check_tokens)
    del engine
    theirs = transformers_greedy(path, plan.device, batch, plan.check_tokens)
    parted = [first_difference(a, b) for a, b in zip(ours, theirs)]
    identical = sum(p is None for p in parted)
    report.checks.append({"model": name, "dtype": "float32", "prompts": len(batch), "tokens": plan.check_tokens,
                          "identical": identical, "first_differences": parted})  # fmt: skip
    print(f"  {'ok  ' if identical == len(batch) else 'FAIL'} {name} float32 greedy vs transformers: "
          f"{identical}/{len(batch)} identical (first differences: {parted})")  # fmt: skip


def check_determinism(report: Report, plan: Plan, name: str, path: Path, vocab: int) -> None:
    """--deterministic: a request's tokens and logprobs alone vs inside a batch of mixed-length
    requests (16 on a GPU), bit for bit."""
    from kvmesh.sampling import SamplingParams

    rows = plan.determinism_batch
    engine = make_engine(path, plan.device, "bfloat16", "deterministic", rows, 128)
    target, others = prompts(vocab, 1, 40, seed=4)[0], prompts(vocab, rows - 1, 8, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=plan.check_tokens, ignore_eos=True, logprobs=5)

    def bits(batch: list[list[int]], at: int, engine=engine) -> tuple:
        done = engine.generate(batch, params)[at]
        return done.token_ids, [(lp.logprob.hex(), [(t, v.hex()) for t, v in lp.top]) for lp in done.logprobs]

    alone = bits([target], 0)
    middle = rows // 2 - 1
    batched = bits([*others[:middle], target, *others[middle:]], middle)  # the target mid-batch
    same = alone == batched
    parted = first_difference(alone[0], batched[0])
    report.determinism.append({"model": name, "dtype": "bfloat16", "batch": rows, "tokens": plan.check_tokens,
                               "bitwise": same, "first_token_difference": parted})  # fmt: skip
    print(f"  {'ok  ' if same else 'FAIL'} {name} bfloat16 --deterministic: alone vs batch of {rows} bitwise "
          f"{'equal' if same else f'different (tokens part at {parted})'}")  # fmt: skip
    del engine


def floor_s(report: Report, weight_bytes: int, params: int, batch: int) -> float:
    """The least time one decode step of ``batch`` rows can take here: all weights read once, or
    the matmuls' FLOPs (2 per parameter per row), whichever bound is higher."""
    read = weight_bytes / (report.ceilings["copy_GBps"] * 1e9)
    compute = 2 * params * batch / (report.ceilings["matmul_bf16_TFLOPs"] * 1e12)
    return max(read, compute)


def measure_speed(report: Report, plan: Plan, name: str, path: Path, vocab: int, params: int, dtype: str) -> None:
    elem = torch.finfo(getattr(torch, dtype)).bits // 8
    for mode in plan.modes:
        t0 = time.perf_counter()
        engine = make_engine(path, plan.device, dtype, mode, max(plan.batches), plan.prompt_len)
        greedy(engine, prompts(vocab, 2, 8, seed=2), 4)  # warm-up (and the compile)
        ready_s = time.perf_counter() - t0
        for batch in plan.batches:
            rows = prompts(vocab, batch, plan.prompt_len, seed=3 + batch)
            full = _timed(lambda e=engine, r=rows: greedy(e, r, plan.new_tokens), plan.device, repeats=1)
            prefill = _timed(lambda e=engine, r=rows: greedy(e, r, 1), plan.device, repeats=1)
            step = max(full - prefill, 1e-9) / (plan.new_tokens - 1)
            floor = floor_s(report, params * elem, params, batch)
            report.speeds.append({
                "model": name, "dtype": dtype, "mode": mode, "batch": batch, "decode_tokens_per_s": batch / step,
                "roofline_tokens_per_s": batch / floor, "fraction_of_roofline": floor / step,
                "step_ms": 1e3 * step, "ready_s": ready_s,
            })  # fmt: skip
            print(f"  {name} {dtype} {mode} batch {batch}: {batch / step:.0f} tok/s, "
                  f"{100 * floor / step:.0f}% of roofline", flush=True)  # fmt: skip
        del engine


def run(plan: Plan, report: Report, budget_s: float | None) -> None:
    """Every part of the plan; past ``budget_s`` (a GPU run's share of its 8 minutes) no further
    speed section starts. A dry run has no budget: its pass or fail never rides on a wall clock."""
    started = time.monotonic()
    guarded(report, "ceilings", lambda: measure_ceilings(report, plan.device, plan.device == "cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in plan.shapes.items():
            path = Path(tmp) / name
            print(f"\n== {name}: writing a random-init checkpoint", flush=True)
            params = write_model(path, shape)
            guarded(report, f"{name}: greedy vs transformers",
                    lambda: check_greedy(report, plan, name, path, shape["vocab_size"]))  # fmt: skip
            if name == next(iter(plan.shapes)):
                guarded(report, f"{name}: deterministic serving",
                        lambda: check_determinism(report, plan, name, path, shape["vocab_size"]))  # fmt: skip
            for dtype in plan.dtypes:
                if budget_s is not None and time.monotonic() - started > budget_s:
                    report.errors.append(f"{name} {dtype} speed: skipped, over the {budget_s:.0f} s budget")
                    continue
                vocab = shape["vocab_size"]
                guarded(report, f"{name}: {dtype} decode speed",
                        lambda: measure_speed(report, plan, name, path, vocab, params, dtype))  # fmt: skip


def print_summary(report: Report) -> None:
    print(f"\n{report.device} | ceilings: copy {report.ceilings.get('copy_GBps', 0):.0f} GB/s, "
          f"bf16 matmul {report.ceilings.get('matmul_bf16_TFLOPs', 0):.1f} TFLOP/s")  # fmt: skip
    print_table(["model", "greedy vs transformers (fp32)", "first differences"],
                [[c["model"], f"{c['identical']}/{c['prompts']} x {c['tokens']}", str(c["first_differences"])]
                 for c in report.checks])  # fmt: skip
    print_table(["model", "--deterministic bf16", "alone vs batched"],
                [[d["model"], f"{d['tokens']} tokens, batch {d['batch']}",
                  "bitwise equal" if d["bitwise"] else "DIFFERENT"]
                 for d in report.determinism])  # fmt: skip
    print_table(["model", "dtype", "mode", "batch", "decode tok/s", "roofline tok/s", "of roofline", "ready s"],
                [[s["model"], s["dtype"], s["mode"], str(s["batch"]), f"{s['decode_tokens_per_s']:.0f}",
                  f"{s['roofline_tokens_per_s']:.0f}", f"{100 * s['fraction_of_roofline']:.0f}%",
                  f"{s['ready_s']:.0f}"] for s in report.speeds])  # fmt: skip
    for e in report.errors:
        print(f"  ERROR {e.splitlines()[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, few tokens")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="start no speed section after this on a GPU (default 240; a dry run has none)",
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_engine: no CUDA device here; --dry-run runs the same code on the CPU", file=sys.stderr)
        return 2
    plan = Plan.dry() if args.dry_run else Plan("cuda", SHAPES)
    import transformers

    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    report = Report(device, {"torch": torch.__version__, "transformers": transformers.__version__})
    started = time.monotonic()
    run(plan, report, None if args.dry_run else args.budget_s)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2) + "\n")
    print_summary(report)
    print(f"\n{'PASSED' if report.passed else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
