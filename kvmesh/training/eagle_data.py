"""``kvmesh train-speculator``'s training data: the ``--data`` sources, read into token sequences.

``code`` and ``chat`` are the target's own greedy continuations (``eagle_corpus``), ``stdlib`` windows of the
standard library's source, ``traffic=PATH`` a deployment's retained requests (the speculator service's
``--retain-traffic`` JSONL). The sequences are cached under ``--cache``, keyed by what made them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine


def parse_data(spec: str) -> list[tuple[str, str | None]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, arg = part.partition("=")
        if name not in ("code", "chat", "stdlib", "traffic") or (name == "traffic") != bool(arg):
            raise SystemExit(f"--data: unknown source {part!r} (code, chat, stdlib, traffic=PATH)")
        out.append((name, arg or None))
    if not out:
        raise SystemExit("--data names no source")
    return out


def stdlib_sequences(engine: LLMEngine, n_tokens: int, window: int, seed: int) -> list[list[int]]:
    from kvmesh.training.corpus import split_files, stdlib_files

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


def generated_sequences(args: argparse.Namespace, names: set[str]) -> list[list[int]]:
    """The target's own continuations of code openings (``code``) and answers to instructions (``chat``)."""
    from kvmesh.training.eagle_corpus import code_prompts, instruction_prompts, target_continuations

    engine = LLMEngine(args.model, EngineConfig(dtype=args.gen_dtype, compile=args.gen_compile, num_blocks=1024))
    tok = engine.tokenizer
    seqs: list[list[int]] = []
    if "code" in names:
        prompts = [tok.encode(t, add_special_tokens=False) for t in code_prompts(args.code_prompts, args.seed)]
        seqs += target_continuations(engine, prompts, args.code_tokens)
    if "chat" in names:
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in instruction_prompts()
        ]
        seqs += target_continuations(engine, prompts, args.answer_tokens)
    return seqs


def corpus(args: argparse.Namespace, sources: list[tuple[str, str | None]], engine: LLMEngine) -> list[list[int]]:
    """Every training window's token ids, from the ``--data`` sources in order."""
    names = {name for name, _ in sources}
    seqs = generated_sequences(args, names) if names & {"code", "chat"} else []
    for name, arg in sources:
        if name == "stdlib":
            seqs += stdlib_sequences(engine, args.stdlib_tokens, args.window, args.seed)
        elif name == "traffic":
            seqs += traffic_sequences(Path(arg), args.window)
    return seqs


def cache_key(parts: list) -> str:
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).hexdigest()


def traffic_sequences(path: Path, window: int) -> list[list[int]]:
    seqs = []
    for line in path.read_text().splitlines():
        if line.strip():
            ids = json.loads(line)["token_ids"]
            seqs.extend(ids[i : i + window] for i in range(0, len(ids), window))
    return [s for s in seqs if len(s) > 8]
