"""Train an EAGLE head for a target model from its own hidden states (``kvmesh train-speculator``).

    kvmesh train-speculator --model PATH --data code,chat,stdlib --out DIR

1. Corpus (``--data``, comma-separated; ``kvmesh.training.eagle_corpus`` builds it):
   ``code`` — ``--code-prompts`` openings of code cut from the Python standard
   library (train split), each continued greedily by the target for
   ``--code-tokens``; ``chat`` — templated instruction prompts answered
   greedily by the target (``--answer-tokens``), so the head sees the target's
   own continuations; ``stdlib`` — windows of the standard library's source
   itself (``--stdlib-tokens`` of them); ``traffic=PATH`` (opt-in: a
   deployment's own finished requests, the JSONL a speculator service started
   with ``--retain-traffic PATH`` writes as its suffix index learns them). The
   target writes its text on an engine of ``--gen-dtype`` (``--gen-compile``:
   compiled), a faster copy of itself; the labels below come from the target
   as served.
2. Features, once: the target (kvmesh's own engine model) runs over every
   window; per position it keeps the final hidden state (``--feature-dtype``,
   float16 by default: 1.1 KB a token at hidden 576), with ``--feature-layers``
   (EAGLE-3 style: a low, a middle and a high layer) those layers' outputs too,
   and the target's own greedy next token (the label: the head learns what the
   *target* says next, not what the corpus says). The corpus and the features
   are cached under ``--cache`` so epochs and reruns never recompute them.
3. Draft vocabulary: the ``--draft-vocab`` ids the target predicts most often
   on that corpus (a draft step then costs hidden x draft_vocab).
4. The head (``kvmesh.speculation.eagle.EagleBlock``) is trained with the
   target's embedding and LM head frozen, unrolled ``--unroll`` steps the way
   it drafts (step j>1 takes its own predicted feature): cross-entropy on the
   target's next token over the draft vocabulary plus a smooth-L1 regression
   on the target's next feature (EAGLE-1's two losses).
5. Saves ``config.json`` (sizes, the target's fingerprint, the data and flags)
   and ``head.safetensors`` (the block, float16, and the draft vocabulary),
   then reports, on held-out positions, the share whose drafts 1..j all agree
   with the target (j = 1..unroll) and the accepted length that implies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.model import AttentionMetadata
from kvmesh.errors import InvalidArgument
from kvmesh.speculation.eagle import FORMAT, EagleBlock, HeadConfig, target_fingerprint
from kvmesh.training.eagle_data import cache_key, corpus, parse_data


def parse_layers(spec: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"--feature-layers: {spec!r} is not a comma-separated list of layer indices") from None


@torch.inference_mode()
def target_features(engine: LLMEngine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(final hidden states [L, h], the target's greedy next token [L], the outputs of the model's
    ``feature_layers`` concatenated [L, n * h] or None) of one window, run as one prefill through
    the engine's own model (the features serving will see)."""
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
    model = engine.model
    hidden, taps = model.body(torch.tensor(ids, device=dev), torch.arange(n, device=dev), engine.kv.tensor, meta)
    labels = torch.matmul(hidden, model.head_weight.t()).argmax(dim=-1)
    layers = torch.cat(taps, dim=-1).float().cpu() if taps else None
    return hidden.float().cpu(), labels.cpu(), layers


def build_features(engine: LLMEngine, seqs: list[list[int]], dtype: torch.dtype) -> dict:
    """Per position of every window: the final hidden state (``features``: the regression target,
    and the first input of a head without feature layers), the layers' outputs (``layer_features``,
    with the model's ``feature_layers``), the token and the target's greedy next token (``labels``)."""
    feats, layer_feats, toks, labels, starts = [], [], [], [], [0]
    t0 = time.perf_counter()
    for i, ids in enumerate(seqs):
        h, y, layers = target_features(engine, ids)
        feats.append(h.to(dtype))
        if layers is not None:
            layer_feats.append(layers.to(dtype))
        toks.append(torch.tensor(ids, dtype=torch.int32))
        labels.append(y.to(torch.int32))
        starts.append(starts[-1] + len(ids))
        if (i + 1) % 10 == 0:
            done = starts[-1]
            print(
                f"features: {i + 1}/{len(seqs)} windows, {done} tokens, {done / (time.perf_counter() - t0):.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    data = {
        "features": torch.cat(feats),
        "tokens": torch.cat(toks),
        "labels": torch.cat(labels),
        "starts": torch.tensor(starts),
    }
    if layer_feats:
        data["layer_features"] = torch.cat(layer_feats)
    return data


def example_starts(starts: torch.Tensor, unroll: int, windows: list[int]) -> torch.Tensor:
    """Positions t of the given windows whose window holds t+1..t+unroll too."""
    bounds = [(int(starts[w]), int(starts[w + 1])) for w in windows]
    out = [torch.arange(a, b - unroll) for a, b in bounds if b - a > unroll]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def unrolled_loss(
    block: EagleBlock,
    data: dict,
    t: torch.Tensor,
    unroll: int,
    emb: torch.Tensor,
    head_w: torch.Tensor,
    vocab_map: torch.Tensor,
    reg_weight: float,
) -> tuple[torch.Tensor, list[float]]:
    """Loss over ``unroll`` drafting steps from positions ``t``; also, per step j, the share of
    positions whose drafts 1..j all agree with the target (a chain of drafts is accepted up to its
    first miss, so 1 + their sum is the expected accepted length at k = ``unroll``)."""
    feats, toks, labels = data["features"], data["tokens"], data["labels"]
    f = block.first_feature(data.get("layer_features", feats)[t].float())
    total, chain = 0.0, []
    alive = torch.ones(len(t), dtype=torch.bool)
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
            alive &= (logits.argmax(-1) == y) & (y >= 0)
            chain.append(float(alive.float().mean()))
    return total / unroll, chain


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvmesh train-speculator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, type=Path, help="the target model folder")
    p.add_argument("--data", default="code,chat,stdlib", help="code, chat, stdlib, traffic=PATH (comma-separated)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvmesh" / "eagle-features")
    p.add_argument("--stdlib-tokens", type=int, default=60_000)
    p.add_argument("--code-prompts", type=int, default=1200)
    p.add_argument("--code-tokens", type=int, default=96)
    p.add_argument("--answer-tokens", type=int, default=160)
    p.add_argument("--gen-dtype", default="float32", help="dtype of the engine the target writes its text on")
    p.add_argument("--gen-compile", action="store_true", help="compile that engine's decode step")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--feature-dtype", choices=["float16", "float32"], default="float16")
    p.add_argument(
        "--feature-layers",
        default="",
        help="EAGLE-3 style: comma-separated target layers (e.g. 2,15,27) whose outputs, concatenated, "
        "are the head's first input instead of the final hidden state",
    )
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--unroll", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--reg-weight", type=float, default=1.0)
    p.add_argument("--heldout-percent", type=int, default=5, help="windows held out for the reported agreement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    sources = parse_data(args.data)
    feature_layers = parse_layers(args.feature_layers)

    engine = LLMEngine(args.model, EngineConfig(num_blocks=max(64, 2 * args.window // 16 + 8)))
    mc = engine.model_config
    try:  # the head's own checks: distinct ascending layers, all inside the target
        cfg = HeadConfig(
            hidden_size=mc.hidden_size,
            intermediate_size=args.intermediate,
            rms_norm_eps=mc.rms_norm_eps,
            feature_layers=feature_layers,
        )
        cfg.check_target_layers(mc.num_layers)
    except InvalidArgument as e:
        raise SystemExit(f"--feature-layers: {e}") from None
    engine.model.feature_layers = feature_layers
    fingerprint = target_fingerprint(engine.model)
    # Two caches: the corpus (the target's text: minutes of generation) and its features (another
    # pass of the target), so a run that only changes what is kept of the target reuses the text.
    corpus_args = [
        fingerprint,
        args.data,
        args.stdlib_tokens,
        args.code_prompts,
        args.code_tokens,
        args.answer_tokens,
        args.gen_dtype,
        args.gen_compile,
        args.window,
        args.seed,
    ]
    corpus_cache = args.cache / f"corpus-{cache_key(corpus_args)}.pt"
    cache = args.cache / f"{cache_key([*corpus_args, args.feature_dtype, feature_layers])}.pt"
    if cache.exists():
        data = torch.load(cache)
        print(f"features: cached {cache}", file=sys.stderr)
    else:
        if corpus_cache.exists():
            seqs = torch.load(corpus_cache)
            print(f"corpus: cached {corpus_cache}", file=sys.stderr)
        else:
            seqs = corpus(args, sources, engine)
            corpus_cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save(seqs, corpus_cache)
        data = build_features(engine, seqs, getattr(torch, args.feature_dtype))
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
    head_w = engine.model.head_weight.detach().float()[draft_vocab].contiguous()
    block = EagleBlock(cfg)
    # Start the output norm at the target's final norm: its features live on that scale.
    with torch.no_grad():
        block.out_norm.weight.copy_(engine.model.norm.detach().float())

    # Whole windows are held out (never positions of a window trained on): the held-out numbers
    # are for text the head has not seen, as in serving.
    n_windows = len(data["starts"]) - 1
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(args.seed)).tolist()
    n_held = max(1, n_windows * args.heldout_percent // 100)
    held = example_starts(data["starts"], args.unroll, order[:n_held])
    train = example_starts(data["starts"], args.unroll, order[n_held:])
    steps = args.epochs * (len(train) // args.batch)
    opt = torch.optim.AdamW(block.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(steps, 1), pct_start=0.05)
    t0, step = time.perf_counter(), 0
    for epoch in range(args.epochs):
        perm = train[torch.randperm(len(train))]
        for i in range(0, len(perm) - args.batch + 1, args.batch):
            loss, chain = unrolled_loss(
                block, data, perm[i : i + args.batch], args.unroll, emb, head_w, vocab_map, args.reg_weight
            )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 25 == 0 or step == steps:
                print(
                    f"epoch {epoch + 1} step {step}/{steps}: loss {loss.item():.3f} "
                    f"drafts 1..j agreeing {[round(a, 3) for a in chain]} ({time.perf_counter() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    with torch.no_grad():
        chain_sum = [0.0] * args.unroll
        for c in torch.split(held, 1024):
            _, chain = unrolled_loss(block, data, c, args.unroll, emb, head_w, vocab_map, args.reg_weight)
            chain_sum = [s + a * len(c) for s, a in zip(chain_sum, chain)]
        heldout = [round(s / max(len(held), 1), 4) for s in chain_sum]
    t_train = time.perf_counter() - t0

    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in block.state_dict().items()}
    save_file({**tensors, "draft_vocab": draft_vocab.to(torch.int32)}, str(args.out / "head.safetensors"))
    meta = {
        "format": FORMAT,
        "head": {
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "rms_norm_eps": cfg.rms_norm_eps,
            "feature_layers": list(cfg.feature_layers),
        },
        "target": {
            "name": args.model.name,
            "fingerprint": fingerprint,
            "architecture": mc.architecture,
            "vocab_size": mc.vocab_size,
            "hidden_size": mc.hidden_size,
        },
        "draft_vocab_size": len(vocab_ids),
        "training": {
            "command": "kvmesh train-speculator " + " ".join(sys.argv[1:] if argv is None else argv),
            "data": args.data,
            "tokens": n_tokens,
            "windows": int(len(data["starts"]) - 1),
            "feature_dtype": args.feature_dtype,
            "feature_layers": list(feature_layers),
            "unroll": args.unroll,
            "epochs": args.epochs,
            "batch": args.batch,
            "lr": args.lr,
            "steps": step,
            "threads": args.threads,
            "draft_vocab_coverage": round(coverage, 4),
            "heldout_chain_agreement_per_step": heldout,
            "heldout_expected_accepted_length": round(1 + sum(heldout), 3),
            "feature_seconds": round(t_features),
            "train_seconds": round(t_train),
        },
    }
    (args.out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta["training"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
