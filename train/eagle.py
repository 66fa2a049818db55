"""Train an EAGLE head for a target model from its own hidden states (``kvmesh train-speculator``).

    kvmesh train-speculator --model PATH --data stdlib,chat --out DIR

1. Corpus (``--data``, comma-separated): ``stdlib`` — windows of the Python
   standard library's own source (train split of ``train.corpus``, files in a
   seeded order, ``--stdlib-tokens`` of them); ``chat`` — instruction prompts
   (``TRAIN_PROMPTS``) answered greedily by the target itself, so the head sees
   the target's own continuations; ``traffic=PATH`` (opt-in: a deployment's own
   finished requests, the JSONL a speculator service started with
   ``--retain-traffic PATH`` writes as its suffix index learns them).
2. Features, once: the target (kvmesh's own engine model) runs over every
   window; per position it keeps the final hidden state (``--feature-dtype``,
   float16 by default: 1.1 KB a token at hidden 576) and the target's own
   greedy next token (the label: the head learns what the *target* says next,
   not what the corpus says). Cached under ``--cache`` so epochs and reruns
   never recompute them.
3. Draft vocabulary: the ``--draft-vocab`` ids the target predicts most often
   on that corpus (a draft step then costs hidden x draft_vocab).
4. The head (``services.speculator.eagle.EagleBlock``) is trained with the
   target's embedding and LM head frozen, unrolled ``--unroll`` steps the way
   it drafts (step j>1 takes its own predicted feature): cross-entropy on the
   target's next token over the draft vocabulary plus a smooth-L1 regression
   on the target's next feature (EAGLE-1's two losses).
5. Saves ``config.json`` (sizes, the target's fingerprint, the data and flags)
   and ``head.safetensors`` (the block, float16, and the draft vocabulary),
   then reports held-out top-1 agreement with the target per unrolled step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh.engine import EngineConfig, LLMEngine, SamplingParams
from kvmesh.engine.model import AttentionMetadata
from services.speculator.eagle import FORMAT, EagleBlock, HeadConfig, lm_head_weight, target_fingerprint

# Instruction prompts the target answers for its own training data. The benchmark's
# chat prompts (bench/speculation.py) are different questions: held out.
TRAIN_PROMPTS = [
    "How do I reverse a list in Python?",
    "What is a Python dictionary and how do I use it?",
    "Explain list comprehensions with an example.",
    "How do I read a file line by line in Python?",
    "What is the difference between a tuple and a list?",
    "Write a Python function that checks whether a string is a palindrome.",
    "How do I handle exceptions in Python?",
    "What does the 'with' statement do in Python?",
    "Write a function that returns the factorial of a number.",
    "How do I sort a list of dictionaries by a key?",
    "Explain what a Python decorator is.",
    "How can I remove duplicates from a list?",
    "What are *args and **kwargs?",
    "Write a Python class for a simple bank account.",
    "How do I merge two dictionaries?",
    "What is a generator in Python?",
    "How do I convert a string to an integer in Python?",
    "Write a function that counts the vowels in a string.",
    "How do I create a virtual environment?",
    "What is the difference between == and is in Python?",
    "Write a Python script that prints the numbers from 1 to 10.",
    "How do I split a string into words?",
    "Explain recursion with a short example.",
    "How do I format a string with f-strings?",
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Write a short poem about the ocean.",
    "Explain photosynthesis in simple terms.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a rainbow form?",
    "Write a short story about a robot learning to paint.",
    "What is machine learning?",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Give me a recipe for a simple pancake.",
    "What is the difference between weather and climate?",
    "Explain how a computer works to a child.",
    "Write an email asking a colleague for a meeting.",
    "What are some good habits for studying?",
]


def parse_data(spec: str) -> list[tuple[str, str | None]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, arg = part.partition("=")
        if name not in ("stdlib", "chat", "traffic") or (name == "traffic") != bool(arg):
            raise SystemExit(f"--data: unknown source {part!r} (stdlib, chat, traffic=PATH)")
        out.append((name, arg or None))
    if not out:
        raise SystemExit("--data names no source")
    return out


def stdlib_sequences(engine: LLMEngine, n_tokens: int, window: int, seed: int) -> list[list[int]]:
    from train.corpus import split_files, stdlib_files

    files = split_files(stdlib_files()).train
    random.Random(seed).shuffle(files)
    seqs, total = [], 0
    for f in files:
        ids = engine.tokenizer.encode(f.text, add_special_tokens=False)
        for i in range(0, len(ids) - 32, window):  # drop scraps too short to teach much
            chunk = ids[i : i + window]
            seqs.append(chunk)
            total += len(chunk)
            if total >= n_tokens:
                return seqs
    return seqs


def chat_sequences(engine: LLMEngine, answer_tokens: int) -> list[list[int]]:
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in TRAIN_PROMPTS]
    done = engine.generate(prompts, SamplingParams(max_tokens=answer_tokens))
    return [c.prompt_ids + c.token_ids for c in done]


def traffic_sequences(path: Path, window: int) -> list[list[int]]:
    seqs = []
    for line in path.read_text().splitlines():
        if line.strip():
            ids = json.loads(line)["token_ids"]
            seqs.extend(ids[i : i + window] for i in range(0, len(ids), window))
    return [s for s in seqs if len(s) > 8]


@torch.inference_mode()
def target_features(engine: LLMEngine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [L, h], the target's greedy next token [L]) of one window, run as
    one prefill through the engine's own model (the features serving will see)."""
    bs, n = engine.config.block_size, len(ids)
    dev = engine.device
    blocks = -(-n // bs)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev),
        block_tables=torch.arange(blocks, device=dev).unsqueeze(0),
        seq_lens=torch.tensor([n], device=dev),
        query_start_loc=torch.tensor([0, n], device=dev),
        is_decode=False,
    )
    logits, hidden = engine.model(
        torch.tensor(ids, device=dev), torch.arange(n, device=dev), engine.kv.tensor, meta,
        torch.arange(n, device=dev), return_hidden=True,
    )
    return hidden.float().cpu(), logits.argmax(dim=-1).cpu()


def build_features(engine: LLMEngine, seqs: list[list[int]], dtype: torch.dtype) -> dict:
    feats, toks, labels, starts = [], [], [], [0]
    t0 = time.perf_counter()
    for i, ids in enumerate(seqs):
        h, y = target_features(engine, ids)
        feats.append(h.to(dtype))
        toks.append(torch.tensor(ids, dtype=torch.int32))
        labels.append(y.to(torch.int32))
        starts.append(starts[-1] + len(ids))
        if (i + 1) % 10 == 0:
            done = starts[-1]
            print(f"features: {i + 1}/{len(seqs)} windows, {done} tokens, {done / (time.perf_counter() - t0):.0f} tok/s",
                  file=sys.stderr, flush=True)
    return {"features": torch.cat(feats), "tokens": torch.cat(toks), "labels": torch.cat(labels),
            "starts": torch.tensor(starts)}


def example_starts(starts: torch.Tensor, unroll: int) -> torch.Tensor:
    """Positions t whose window holds t+1..t+unroll too."""
    out = [torch.arange(a, b - unroll) for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()) if b - a > unroll]
    return torch.cat(out)


def unrolled_loss(block: EagleBlock, data: dict, t: torch.Tensor, unroll: int, emb: torch.Tensor,
                  head_w: torch.Tensor, vocab_map: torch.Tensor, reg_weight: float) -> tuple[torch.Tensor, list[float]]:
    """Loss over ``unroll`` drafting steps from positions ``t``; also each step's top-1 agreement."""
    feats, toks, labels = data["features"], data["tokens"], data["labels"]
    f = feats[t].float()
    total, agree = 0.0, []
    for j in range(1, unroll + 1):
        pos = t + j
        f = block(f, emb[toks[pos].long()])
        logits = f @ head_w.t()
        y = vocab_map[labels[pos].long()]  # -1: outside the draft vocabulary
        ce = F.cross_entropy(logits, y.clamp(min=0), reduction="none")
        mask = (y >= 0).float()
        total = total + (ce * mask).sum() / mask.sum().clamp(min=1)
        total = total + reg_weight * F.smooth_l1_loss(f, feats[pos].float())
        with torch.no_grad():
            agree.append(float(((logits.argmax(-1) == y) & (y >= 0)).float().mean()))
    return total / unroll, agree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh train-speculator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="the target model folder")
    p.add_argument("--data", default="stdlib,chat", help="stdlib, chat, traffic=PATH (comma-separated)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvmesh" / "eagle-features")
    p.add_argument("--stdlib-tokens", type=int, default=24_000)
    p.add_argument("--answer-tokens", type=int, default=160)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--feature-dtype", choices=["float16", "float32"], default="float16")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--unroll", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--reg-weight", type=float, default=1.0)
    p.add_argument("--heldout-percent", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    sources = parse_data(args.data)

    engine = LLMEngine(args.model, EngineConfig(num_blocks=max(64, 2 * args.window // 16 + 8)))
    mc = engine.model_config
    fingerprint = target_fingerprint(engine.model)
    key = hashlib.blake2b(json.dumps([fingerprint, args.data, args.stdlib_tokens, args.answer_tokens, args.window,
                                      args.feature_dtype, args.seed]).encode(), digest_size=8).hexdigest()
    cache = args.cache / f"{key}.pt"
    if cache.exists():
        data = torch.load(cache)
        print(f"features: cached {cache}", file=sys.stderr)
    else:
        seqs: list[list[int]] = []
        for name, arg in sources:
            if name == "stdlib":
                seqs += stdlib_sequences(engine, args.stdlib_tokens, args.window, args.seed)
            elif name == "chat":
                t0 = time.perf_counter()
                seqs += chat_sequences(engine, args.answer_tokens)
                print(f"chat: {len(TRAIN_PROMPTS)} answers in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            else:
                seqs += traffic_sequences(Path(arg), args.window)
        data = build_features(engine, seqs, getattr(torch, args.feature_dtype))
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, cache)
    t_features = time.perf_counter() - t_start
    n_tokens = int(data["tokens"].numel())

    counts = Counter(data["labels"].tolist())
    vocab_ids = sorted(t for t, _ in counts.most_common(args.draft_vocab))
    coverage = sum(counts[t] for t in vocab_ids) / n_tokens
    draft_vocab = torch.tensor(vocab_ids, dtype=torch.long)
    vocab_map = torch.full((mc.vocab_size,), -1, dtype=torch.long)
    vocab_map[draft_vocab] = torch.arange(len(vocab_ids))

    emb = engine.model.embed_tokens.weight.detach().float()
    head_w = lm_head_weight(engine.model).detach().float()[draft_vocab].contiguous()
    cfg = HeadConfig(hidden_size=mc.hidden_size, intermediate_size=args.intermediate, rms_norm_eps=mc.rms_norm_eps)
    block = EagleBlock(cfg)
    # Start the output norm at the target's final norm: its features live on that scale.
    with torch.no_grad():
        block.out_norm.weight.copy_(engine.model.norm.detach().float())

    ts = example_starts(data["starts"], args.unroll)
    order = torch.randperm(len(ts), generator=torch.Generator().manual_seed(args.seed))
    n_held = len(ts) * args.heldout_percent // 100
    held, train = ts[order[:n_held]], ts[order[n_held:]]
    steps = args.epochs * (len(train) // args.batch)
    opt = torch.optim.AdamW(block.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(steps, 1), pct_start=0.05)
    t0, step = time.perf_counter(), 0
    for epoch in range(args.epochs):
        perm = train[torch.randperm(len(train))]
        for i in range(0, len(perm) - args.batch + 1, args.batch):
            loss, agree = unrolled_loss(block, data, perm[i : i + args.batch], args.unroll, emb, head_w, vocab_map,
                                        args.reg_weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 25 == 0 or step == steps:
                print(f"epoch {epoch + 1} step {step}/{steps}: loss {loss.item():.3f} "
                      f"top-1 per step {[round(a, 3) for a in agree]} ({time.perf_counter() - t0:.0f}s)",
                      file=sys.stderr, flush=True)
    with torch.no_grad():
        agree_sum = [0.0] * args.unroll
        chunks = list(torch.split(held, 1024))
        for c in chunks:
            _, agree = unrolled_loss(block, data, c, args.unroll, emb, head_w, vocab_map, args.reg_weight)
            agree_sum = [s + a * len(c) for s, a in zip(agree_sum, agree)]
        heldout = [round(s / max(len(held), 1), 4) for s in agree_sum]
    t_train = time.perf_counter() - t0

    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in block.state_dict().items()}
    save_file({**tensors, "draft_vocab": draft_vocab.to(torch.int32)}, str(args.out / "head.safetensors"))
    meta = {
        "format": FORMAT,
        "head": {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                 "rms_norm_eps": cfg.rms_norm_eps},
        "target": {"name": args.model.name, "fingerprint": fingerprint, "architecture": mc.architecture,
                   "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size},
        "draft_vocab_size": len(vocab_ids),
        "training": {
            "command": "kvmesh train-speculator " + " ".join(sys.argv[1:] if argv is None else argv),
            "data": args.data, "tokens": n_tokens, "windows": int(len(data["starts"]) - 1),
            "feature_dtype": args.feature_dtype, "unroll": args.unroll, "epochs": args.epochs,
            "batch": args.batch, "lr": args.lr, "steps": step, "threads": args.threads,
            "draft_vocab_coverage": round(coverage, 4),
            "heldout_top1_agreement_per_step": heldout,
            "feature_seconds": round(t_features), "train_seconds": round(t_train),
        },
    }
    (args.out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta["training"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
