"""Served throughput of quantized checkpoints beside the unquantized model, in-process, same run.

    flock /tmp/kvmesh-bench.lock python bench/quantized_serving.py --json bench/results/quantized_serving.json

16 chat questions x 64 greedy tokens (EOS ignored), all in flight, on the default model
(the anchor) and on its fp8-channel / int8-channel / nvfp4 checkpoints written by
kvmesh.quant. On CPU every format is dequantized on load to the compute dtype, so the
matmuls are the anchor's: expect the same speed (the saving is bytes on disk); on CUDA an
fp8 checkpoint served with --quantization fp8 runs the Triton fp8 kernel instead.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import write_json  # noqa: E402
from _table import print_table  # noqa: E402
from engine import chat_prompts, make_engine  # noqa: E402

FORMATS = ("fp8-channel", "int8-channel", "nvfp4")


def main() -> None:
    from kvmesh.checkpoint.compressed import linear_modules, write_checkpoint
    from kvmesh.checkpoint.files import iter_tensors, weight_files
    from kvmesh.engine.default_model import default_model_path
    from kvmesh.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", default="bench/results/quantized_serving.json")
    args = ap.parse_args()
    src = args.model or default_model_path()
    prompts = chat_prompts(src, args.requests)
    modules = linear_modules([n for n, _ in iter_tensors(weight_files(src))])
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"unquantized (anchor)": src}
        for fmt in FORMATS:
            folders[fmt] = write_checkpoint(src, Path(tmp) / fmt, {m: fmt for m in modules})
        for name, folder in folders.items():
            engine = make_engine(folder, args.dtype)
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            tps = args.requests * args.new_tokens / (time.perf_counter() - t0)
            disk = sum(f.stat().st_size for f in weight_files(folder)) / 2**20
            out[name] = {"tokens_per_s": tps, "weights_mib": disk}
            del engine
    anchor = out["unquantized (anchor)"]["tokens_per_s"]
    for name, r in out.items():
        r["ratio"] = r["tokens_per_s"] / anchor
        rows.append([name, f"{r['tokens_per_s']:.1f}", f"{r['ratio']:.2f}", f"{r['weights_mib']:.0f}"])
    print_table(["checkpoint", "tokens/s", "vs anchor", "weights MiB"], rows)
    write_json(args.json, {"requests": args.requests, "new_tokens": args.new_tokens, "dtype": args.dtype, "rows": out})


if __name__ == "__main__":
    main()
