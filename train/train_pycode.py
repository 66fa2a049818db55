"""Train pycode-small: a small Llama that writes Python, from the CPython stdlib alone.

    python -m train.train_pycode --out models/pycode-small

Steps: list the stdlib's .py files (sorted; ~3% held out by a hash of the
path), train a byte-level BPE tokenizer on the training files (the engine's
own ``train_tokenizer``), train a ``LlamaForCausalLM`` on random windows of
the token stream (bf16 autocast, AdamW, warmup + cosine), save it as a
standard Hugging Face folder with bf16 weights, then measure the held-out
loss of the saved weights in float32 and write the README.

Seeded throughout. It runs on CPU with 2 threads; ``--minutes`` caps the
wall clock (see ``loop.Budget``) so a busy machine still finishes on time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from kvmesh.models.bpe import train_tokenizer, write_tokenizer
from kvmesh.training.corpus import random_windows, split_files, stdlib_files, tiled_windows, token_stream
from train.loop import Budget, adamw, heldout_loss, lr_at, set_lr
from train.model_card import greedy_completion, param_count, save_bf16, write_readme

EOS = "<|endoftext|>"
LABEL = "pycode-small (a small Python code model trained on the CPython standard library)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=896)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument("--minutes", type=float, default=34.0, help="wall-clock budget of the training loop")
    p.add_argument("--valid-percent", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="torch device; a GPU trains far longer in the same minutes")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (faster start, slower steps)")
    p.add_argument("--valid-limit", type=int, default=0, help="score only this many held-out windows (0: all)")
    return p.parse_args(argv)


def log(**fields) -> None:
    print(json.dumps(fields), flush=True)


def build_model(args: argparse.Namespace, vocab_size: int, eos_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.context,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config.kvmesh_label = LABEL
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def next_token_loss(model: LlamaForCausalLM, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    split = split_files(stdlib_files(), args.valid_percent)
    tok = train_tokenizer(args.vocab, texts=[f.text for f in split.train])
    eos_id = tok.token_to_id(EOS)
    train_ids = token_stream(tok, split.train, eos_id)
    valid_ids = token_stream(tok, split.valid, eos_id)
    valid_bytes = sum(len(f.text.encode()) for f in split.valid)
    log(
        event="data",
        train_files=len(split.train),
        valid_files=len(split.valid),
        train_tokens=len(train_ids),
        valid_tokens=len(valid_ids),
        valid_bytes_per_token=round(valid_bytes / len(valid_ids), 3),
        prep_s=round(time.monotonic() - t0, 1),
    )
    valid = tiled_windows(valid_ids, args.context)
    if args.valid_limit:
        valid = valid[: args.valid_limit]

    model = build_model(args, tok.get_vocab_size(), eos_id).to(args.device)
    n_params = param_count(model)
    log(event="model", params=n_params)
    opt = adamw(model, args.lr, args.weight_decay)
    step_loss = next_token_loss if args.no_compile else torch.compile(next_token_loss)
    gen = torch.Generator().manual_seed(args.seed)

    budget = Budget(args.max_steps, args.minutes)
    step, tokens, ema = 0, 0, None
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), args.lr, args.warmup_steps))
        x = random_windows(train_ids, args.batch, args.context, gen).to(args.device)
        loss = step_loss(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0:
            log(
                event="train",
                step=step,
                loss=round(ema, 4),
                lr=opt.param_groups[0]["lr"],
                tok_s=round(tokens / budget.elapsed_s),
                elapsed_min=round(budget.elapsed_s / 60, 2),
            )
        if args.eval_every and step % args.eval_every == 0:
            loss_v, _ = heldout_loss(model, valid[:32])
            log(event="eval", step=step, heldout_loss_subset=round(loss_v, 4))
    train_s = budget.elapsed_s

    save_bf16(model, args.out)
    write_tokenizer(tok, args.out, model_max_length=args.context)

    # Score what ships: the saved bf16 weights, computed in float32 as the engine does on CPU.
    shipped = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    loss_v, scored = heldout_loss(shipped, valid)
    bpb = loss_v / math.log(2) / (valid_bytes / len(valid_ids))
    log(event="heldout", loss=round(loss_v, 4), tokens=scored, bits_per_byte=round(bpb, 4))
    sample = greedy_completion(args.out)
    log(event="sample", text=sample)

    write_readme(
        args.out,
        "pycode-small",
        "kvmesh's default model: a small Llama-architecture model trained from scratch on the "
        "CPython standard library's own `.py` files (no download), in well under an hour on 2 CPU cores. "
        "That budget teaches it the surface of Python (indentation, keywords, `self.`, docstrings, "
        "test-suite idioms), not how to write correct programs: it shows that the mesh serves a real "
        "model; it is not a coding assistant.",
        {
            "architecture": f"LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, "
            f"{args.heads} heads ({args.kv_heads} KV heads), MLP {args.intermediate}, tied embeddings",
            "parameters": f"{n_params:,}",
            "context": f"{args.context} tokens",
            "weights": "bfloat16 safetensors",
            "tokenizer": f"byte-level BPE, {tok.get_vocab_size()} tokens, `{EOS}` = end of text, ChatML template",
            "data": f"{len(split.train)} stdlib .py files ({len(train_ids):,} tokens) for training; "
            f"{len(split.valid)} held out ({len(valid_ids):,} tokens), chosen by a hash of the path",
            "training": f"{step} steps x {args.batch} x {args.context} tokens ({tokens:,} tokens), "
            f"{train_s / 60:.1f} min on {args.device if args.device != 'cpu' else f'{args.threads} CPU threads'} "
            f"(+{(time.monotonic() - t0 - train_s) / 60:.1f} min data, tokenizer, saving, scoring)",
            "held-out loss": f"{loss_v:.3f} nats/token ({bpb:.3f} bits/byte) over {scored:,} held-out tokens",
        },
        "python -m train.train_pycode " + " ".join(sys.argv[1:]),
        sample,
    )
    log(event="done", out=str(args.out), total_min=round((time.monotonic() - t0) / 60, 2))


if __name__ == "__main__":
    train(parse_args())
