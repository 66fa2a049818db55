"""Distill pycode-draft: a small 2-layer draft model that imitates pycode-small, for speculation.

    python -m train.distill_draft --teacher models/pycode-small --out models/pycode-draft

A draft model is only as good as its agreement with the target, so it is
trained on the target's behaviour, not on the data alone:

1. Build a much cheaper model (``--layers`` layers, ``--hidden`` wide): a draft
   only pays when it costs a small fraction of a target step, and the output
   head alone costs vocab x hidden per token. Its embedding starts as the
   teacher's, projected onto its top principal directions, so tokens the
   teacher treats alike start alike; the layers start random.
2. Generate continuations with the teacher from training-file prompts, half
   greedy (what greedy serving produces) and half sampled (coverage).
3. Train the draft to match the teacher's full next-token distribution (KL)
   on those sequences and on real training windows, the teacher's logits
   computed on the fly.
4. Report the held-out loss, top-1 agreement with the teacher and the
   acceptance rate greedy speculation with k drafts would get, both on
   held-out files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from kvmesh.training.corpus import random_windows, split_files, stdlib_files, tiled_windows, token_stream
from train.loop import Budget, adamw, heldout_loss, lr_at, set_lr
from train.model_card import greedy_completion, param_count, save_bf16, write_readme

LABEL = "pycode-draft (a small draft model distilled from pycode-small, for speculative decoding)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", type=Path, default=Path("models/pycode-small"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--valid-percent", type=int, default=3, help="must match the teacher's split")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=192)
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--gen-minutes", type=float, default=4.0, help="time for teacher generation")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--minutes", type=float, default=8.0, help="time for distillation training")
    p.add_argument("--k", type=int, default=4, help="draft length for the acceptance estimate")
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    return p.parse_args(argv)


def log(**fields) -> None:
    print(json.dumps(fields), flush=True)


def build_draft(teacher: LlamaForCausalLM, args: argparse.Namespace) -> LlamaForCausalLM:
    """A small model with the teacher's vocabulary and an embedding projected from the teacher's."""
    cfg = LlamaConfig.from_dict(teacher.config.to_dict())
    cfg.num_hidden_layers = args.layers
    cfg.hidden_size = args.hidden
    cfg.num_attention_heads = args.heads
    cfg.num_key_value_heads = args.kv_heads
    cfg.head_dim = args.hidden // args.heads
    cfg.intermediate_size = args.intermediate
    cfg.kvmesh_label = LABEL
    torch.manual_seed(args.seed)
    draft = LlamaForCausalLM(cfg).float()
    emb = teacher.get_input_embeddings().weight.detach().float()
    u, s, _ = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
    projected = u[:, : args.hidden] * s[: args.hidden]
    # Keep the teacher's per-coordinate scale so the (tied) output logits start in range.
    projected *= emb.std() / projected.std()
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(projected)
    return draft


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen).squeeze(-1)


@torch.no_grad()
def continue_with(
    model: LlamaForCausalLM, prompts: torch.Tensor, n_new: int, temperature: float, gen: torch.Generator
) -> torch.Tensor:
    """Prompts followed by ``n_new`` tokens of the model's own, end-of-text included (it is data too)."""
    out = model(input_ids=prompts, use_cache=True)
    seqs = [prompts]
    for _ in range(n_new):
        nxt = pick(out.logits[:, -1], temperature, gen)
        seqs.append(nxt[:, None])
        out = model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(seqs, 1)


def generate_pool(
    teacher: LlamaForCausalLM, stream: torch.Tensor, args: argparse.Namespace, gen: torch.Generator
) -> torch.Tensor:
    """Teacher continuations of training prompts until the generation budget is spent."""
    pool, started = [], time.monotonic()
    while time.monotonic() - started < args.gen_minutes * 60:
        prompts = random_windows(stream, args.gen_batch, args.prompt_len, gen)
        temperature = 0.0 if len(pool) % 2 == 0 else 1.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pool.append(continue_with(teacher, prompts, args.gen_len, temperature, gen))
        log(event="generate", batches=len(pool), temperature=temperature, elapsed_s=round(time.monotonic() - started))
    return torch.cat(pool)


def distill_loss(draft: LlamaForCausalLM, x: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || draft) per position, averaged."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = draft(input_ids=x).logits
    logp = F.log_softmax(logits.float(), -1)
    return F.kl_div(logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.no_grad()
def teacher_log_probs(teacher: LlamaForCausalLM, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = teacher(input_ids=x).logits
    return F.log_softmax(logits.float(), -1)


@torch.no_grad()
def speculation_estimate(draft: LlamaForCausalLM, seqs: torch.Tensor, prompt_len: int, k: int) -> tuple[float, float]:
    """(top-1 agreement, greedy acceptance rate with k drafts) on the teacher's greedy continuations.

    Along a greedy trajectory the target's tokens are its argmaxes, so the draft's
    proposals given any accepted prefix are its argmaxes on that prefix: one forward
    pass scores every position, and walking it in steps of (accepted + 1) replays
    what the engine's verification would accept.
    """
    match = draft(input_ids=seqs).logits.argmax(-1)[:, :-1] == seqs[:, 1:]
    region = match[:, prompt_len - 1 :]
    proposed = accepted = 0
    for row in region.tolist():
        i = 0
        while i + k <= len(row):
            run = 0
            while run < k and row[i + run]:
                run += 1
            proposed += k
            accepted += run
            i += run + 1
    return region.float().mean().item(), accepted / max(proposed, 1)


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    gen = torch.Generator().manual_seed(args.seed)
    tok = Tokenizer.from_file(str(args.teacher / "tokenizer.json"))
    eos_id = tok.token_to_id("<|endoftext|>")
    split = split_files(stdlib_files(), args.valid_percent)
    train_ids = token_stream(tok, split.train, eos_id)
    valid_ids = token_stream(tok, split.valid, eos_id)
    teacher = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    context = teacher.config.max_position_embeddings
    draft = build_draft(teacher, args)
    log(event="setup", draft_params=param_count(draft), prep_s=round(time.monotonic() - t0, 1))

    pool = generate_pool(teacher, train_ids, args, gen)
    gen_s = time.monotonic() - t0
    log(event="pool", sequences=len(pool), tokens=pool.numel())

    seq_len = args.prompt_len + args.gen_len
    opt = adamw(draft, args.lr, 0.0)
    step_loss = distill_loss if args.no_compile else torch.compile(distill_loss)
    budget = Budget(args.max_steps, args.minutes)
    step, ema = 0, None
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), args.lr, args.warmup_steps))
        # Half the batch the teacher's own text, half real code.
        own = pool[torch.randint(0, len(pool), (args.batch // 2,), generator=gen)]
        real = random_windows(train_ids, args.batch - args.batch // 2, seq_len, gen)
        x = torch.cat([own, real])
        loss = step_loss(draft, x, teacher_log_probs(teacher, x))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0:
            log(event="train", step=step, kl=round(ema, 4), elapsed_min=round(budget.elapsed_s / 60, 2))
    train_s = budget.elapsed_s

    save_bf16(draft, args.out)
    for name in TOKENIZER_FILES:
        shutil.copy(args.teacher / name, args.out / name)

    shipped = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    valid = tiled_windows(valid_ids, context)
    loss_v, scored = heldout_loss(shipped, valid)
    teacher_loss, _ = heldout_loss(teacher, valid)
    prompts = random_windows(
        valid_ids, args.eval_prompts, args.prompt_len, torch.Generator().manual_seed(args.seed + 1)
    )
    greedy = continue_with(teacher, prompts, args.gen_len, 0.0, gen)
    agreement, acceptance = speculation_estimate(shipped, greedy, args.prompt_len, args.k)
    log(
        event="heldout",
        loss=round(loss_v, 4),
        teacher_loss=round(teacher_loss, 4),
        tokens=scored,
        top1_agreement=round(agreement, 4),
        acceptance_k=round(acceptance, 4),
    )
    sample = greedy_completion(args.out)

    cfg = shipped.config
    write_readme(
        args.out,
        "pycode-draft",
        "The draft model for speculative decoding with `models/pycode-small` (same tokenizer), "
        "distilled on the teacher's own outputs (KL to its next-token distribution on teacher-generated "
        "and real code), its embedding initialised from the teacher's principal directions. "
        "Use it with `kvmesh/speculation/draft_model.py` (`DraftModelProposer`).",
        {
            "architecture": f"LlamaForCausalLM, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} KV heads), MLP {cfg.intermediate_size}, "
            "tied embeddings",
            "parameters": f"{param_count(shipped):,}",
            "weights": "bfloat16 safetensors",
            "distillation data": f"{len(pool)} teacher continuations ({args.prompt_len}-token stdlib prompts + "
            f"{args.gen_len} tokens, half greedy, half sampled at T=1) and real training windows",
            "training": f"{gen_s / 60:.1f} min data + generation, then {step} steps x {args.batch} x {seq_len} "
            f"tokens in {train_s / 60:.1f} min on {args.threads} CPU threads",
            "held-out loss": f"{loss_v:.3f} nats/token over {scored:,} held-out tokens (teacher: {teacher_loss:.3f})",
            "agreement with the teacher": f"top-1 {agreement:.1%} on teacher-greedy continuations of "
            f"{args.eval_prompts} held-out prompts",
            f"greedy acceptance at k={args.k}": f"{acceptance:.1%} (replayed offline on the same continuations; "
            "`bench/speculation.py` measures it in the engine)",
        },
        "python -m train.distill_draft " + " ".join(sys.argv[1:]),
        sample,
    )
    log(event="done", out=str(args.out), total_min=round((time.monotonic() - t0) / 60, 2))


if __name__ == "__main__":
    main(parse_args())
