"""Engine throughput: kvmesh continuous batching vs transformers generate, same run.

16 concurrent greedy requests (64-token prompts, 128 new tokens) on a
transformers-written Llama checkpoint of ~30M parameters:
  (a) kvmesh's engine, all requests in flight at once (continuous batching);
  (b) the anchor: transformers ``generate``, one request at a time.
Prints tokens/s for both and the ratio, checks the outputs are identical, and
writes JSON. Run: ``python bench/engine.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402


def write_model(path: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        # A wider init than training would use keeps random logits peaked, so greedy
        # comparisons are not decided by float rounding between two implementations.
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def run_kvmesh(path: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from kvmesh.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(path, EngineConfig(num_blocks=256, max_num_seqs=32, max_num_batched_tokens=1024))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - t0, [r.token_ids for r in results]


def run_transformers(path: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]]), generation_config=GenerationConfig(max_new_tokens=2))
        t0 = time.perf_counter()
        for p in prompts:
            seq = model.generate(torch.tensor([p]), generation_config=gen)
            outs.append(seq[0, len(p) :].tolist())
    return time.perf_counter() - t0, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default="bench/results/engine.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-30m"
        n_params = write_model(path)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 8192, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
        kv_s, kv_out = run_kvmesh(path, prompts, args.new_tokens)
        hf_s, hf_out = run_transformers(path, prompts, args.new_tokens)

    total = args.requests * args.new_tokens
    identical = sum(a == b for a, b in zip(kv_out, hf_out))
    result = {
        "params": n_params,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "kvmesh": {"seconds": kv_s, "tokens_per_s": total / kv_s},
        "transformers_sequential": {"seconds": hf_s, "tokens_per_s": total / hf_s},
        "ratio": hf_s / kv_s,
        "identical_outputs": f"{identical}/{args.requests}",
        "torch_threads": torch.get_num_threads(),
    }
    print(f"engine benchmark: {n_params / 1e6:.1f}M params, {args.requests} requests x "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, greedy, CPU fp32")
    print_table(
        ["run", "seconds", "tokens/s"],
        [
            ["kvmesh (continuous batching)", f"{kv_s:.2f}", f"{total / kv_s:.1f}"],
            ["transformers generate (1 at a time)", f"{hf_s:.2f}", f"{total / hf_s:.1f}"],
        ],
    )
    print(f"ratio kvmesh / transformers: {result['ratio']:.2f}x   identical outputs: {result['identical_outputs']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
