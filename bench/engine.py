"""Engine throughput: kvmesh continuous batching vs transformers generate, same run.

16 greedy requests x 128 new tokens (EOS ignored) on the real default model
(SmolLM2-135M-Instruct, 16 chat-templated questions as prompts), or with
``--model random`` on a transformers-written random Llama of ~30M parameters
(64-token random prompts):
  (a) kvmesh's engine, all requests in flight at once (continuous batching);
  (b) kvmesh's engine, one request alone (single-stream decode speed);
  (c) the anchor: transformers ``generate``, one request at a time.
Prints tokens/s for each and the ratios, checks the outputs are identical, and
writes JSON. Run: ``python bench/engine.py [--model PATH|random] [--dtype bfloat16] [--compile] [--json PATH]``.
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
from roofline import ceilings  # noqa: E402


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


# Real chat questions for the real model (the same kind of workload bench/peers.py runs).
QUESTIONS = [
    "What is the capital of France?",
    "Explain what a Python list comprehension is.",
    "Write a haiku about autumn leaves.",
    "How do vaccines train the immune system?",
    "Give three tips for writing clear emails.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a hash table work?",
    "Why is the sky blue?",
    "Suggest a name for a bakery that sells bread and books.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how photosynthesis works.",
    "Write a short story opening about a lighthouse keeper.",
    "What are prime numbers? Give examples.",
    "How can I make my code easier to test?",
    "Explain recursion to a ten-year-old.",
]


def chat_prompts(path: Path, n: int) -> list[list[int]]:
    from kvmesh.engine.tokenizer import Tokenizer

    tok = Tokenizer(path)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}]) for q in (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def make_engine(
    path: Path,
    dtype: str,
    compile: bool = False,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    deterministic: bool = False,
):
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.sampling import SamplingParams

    # No prefix cache: every run computes its whole prompt, as the anchor does.
    engine = LLMEngine(
        path,
        EngineConfig(
            dtype=dtype,
            num_blocks=512,
            max_num_seqs=32,
            max_num_batched_tokens=1024,
            enable_prefix_cache=False,
            compile=compile,
            quantization=quantization,
            quantize_lm_head=quantize_lm_head,
            deterministic=deterministic,
        ),
    )
    engine.generate(
        [[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )  # warm-up
    return engine


def run_kvmesh(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from kvmesh.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - t0, [r.token_ids for r in results]


def run_transformers(
    path: Path, prompts: list[list[int]], new_tokens: int, dtype: str
) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]]), generation_config=GenerationConfig(max_new_tokens=2))
        t0 = time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            outs.append(seq[0, len(p) :].tolist())
    return time.perf_counter() - t0, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'random' (30M), or a folder")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64, help="random model only: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (EngineConfig.compile)")
    ap.add_argument(
        "--quantization",
        choices=("int8",),
        help="8-bit weights (EngineConfig.quantization); "
        "transformers runs the unquantized model, so outputs are not compared then",
    )
    ap.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: the LM head's too")
    ap.add_argument("--json", default="bench/results/engine.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random":
            path = Path(tmp) / "llama-30m"
            write_model(path)
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(1, 8192, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
        else:
            from kvmesh.engine.default_model import default_model_path

            path = default_model_path() if args.model == "default" else Path(args.model)
            prompts = chat_prompts(path, args.requests)
        engine = make_engine(path, args.dtype, args.compile, args.quantization, args.quantize_lm_head)
        model = engine.model  # 8-bit weights are buffers; a tied head's 8-bit copy is no extra weight
        n_params = sum(p.numel() for p in model.parameters()) + sum(
            m.qweight.numel() for m in model.modules() if hasattr(m, "qweight") and m is not model.head_proj
        )
        kv_s, kv_out = run_kvmesh(engine, prompts, args.new_tokens)
        one_s, one_out = run_kvmesh(engine, prompts[:1], args.new_tokens)
        roof = ceilings(engine.model, args.requests, engine.dtype)
        del engine
        hf_s, hf_out = run_transformers(path, prompts, args.new_tokens, args.dtype)

    total = args.requests * args.new_tokens
    identical = sum(a == b for a, b in zip(kv_out, hf_out))
    result = {
        "model": str(args.model),
        "dtype": args.dtype,
        "compile": args.compile,
        "quantization": args.quantization,
        "quantize_lm_head": args.quantize_lm_head,
        "params": n_params,
        "requests": args.requests,
        "prompt_lens": [min(map(len, prompts)), max(map(len, prompts))],
        "new_tokens": args.new_tokens,
        "kvmesh": {"seconds": kv_s, "tokens_per_s": total / kv_s},
        "kvmesh_one_alone": {"seconds": one_s, "tokens_per_s": args.new_tokens / one_s},
        "transformers_sequential": {"seconds": hf_s, "tokens_per_s": total / hf_s},
        "ratio": hf_s / kv_s,
        "identical_outputs": f"{identical}/{args.requests}",
        "one_alone_identical_to_batched": one_out[0] == kv_out[0],
        "torch_threads": torch.get_num_threads(),
        "roofline": roof,
        "fraction_of_roofline": {
            "batch": (total / kv_s) / roof[f"batch{args.requests}_tokens_per_s"],
            "one_alone": (args.new_tokens / one_s) / roof["batch1_tokens_per_s"],
        },
    }
    print(
        f"engine benchmark: {args.model} ({n_params / 1e6:.1f}M params), {args.requests} requests x "
        f"{result['prompt_lens'][0]}-{result['prompt_lens'][1]} prompt + {args.new_tokens} new tokens, "
        f"greedy, CPU {args.dtype}"
        f"{', compiled decode' if args.compile else ''}{f', {args.quantization} weights' if args.quantization else ''}"
    )
    print_table(
        ["run", "seconds", "tokens/s"],
        [
            [f"kvmesh, {args.requests} at once (continuous batching)", f"{kv_s:.2f}", f"{total / kv_s:.1f}"],
            ["kvmesh, 1 alone", f"{one_s:.2f}", f"{args.new_tokens / one_s:.1f}"],
            ["transformers generate (1 at a time)", f"{hf_s:.2f}", f"{total / hf_s:.1f}"],
        ],
    )
    print(f"ratio kvmesh / transformers: {result['ratio']:.2f}x   identical outputs: {result['identical_outputs']}")
    frac = result["fraction_of_roofline"]
    print(
        f"roofline: batch {args.requests} = {roof[f'batch{args.requests}_tokens_per_s']:.0f} tok/s "
        f"(the step's matmuls alone, {roof[f'batch{args.requests}_matmul_gflop_s']:.0f} GFLOP/s), "
        f"batch 1 = {roof['batch1_tokens_per_s']:.0f} tok/s "
        f"(weights {roof['weight_bytes'] / 1e6:.0f} MB at {roof['copy_bandwidth_gb_s']:.1f} GB/s copy bandwidth)"
    )
    print(
        f"kvmesh at {frac['batch']:.0%} of the batch-{args.requests} roofline, "
        f"{frac['one_alone']:.0%} of the batch-1 roofline"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
