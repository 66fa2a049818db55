"""The fixed evaluation set: held-out text plus chat prompts answered by the model.

Held-out text: Python standard-library source files (code, docstrings and comments; read
from this interpreter's stdlib, used nowhere else in kvmesh), cut into fixed-length chunks.
Chat: each prompt in the chat template followed by the reference model's own greedy answer,
so the set also covers what the model says when serving. Deterministic for a given Python
and model; ``fingerprint`` names the exact token ids so two reports can be checked to match.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch

STDLIB_FILES = (
    "textwrap.py", "fractions.py", "heapq.py", "bisect.py", "calendar.py", "shlex.py", "statistics.py",
    "difflib.py", "string.py", "colorsys.py", "sched.py", "graphlib.py", "ipaddress.py", "tokenize.py",
)  # fmt: skip
CHAT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a beginner.",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into Spanish.",
    "List the planets of the solar system in order.",
    "How do I make a cup of green tea?",
    "What does HTTP status code 404 mean?",
    "Write a haiku about autumn.",
)
Generate = Callable[[list[int]], list[int]]  # prompt ids -> the reference's greedy answer ids


def text_chunks(tokenizer, tokens: int, chunk_len: int) -> list[torch.Tensor]:
    """At least ``tokens`` scored positions of stdlib text in chunks of ``chunk_len`` ids."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((stdlib / name).read_text(encoding="utf-8") for name in STDLIB_FILES)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks, pos = [], 0
    while sum(len(c) - 1 for c in chunks) < tokens:
        if pos + chunk_len > len(ids):
            raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than {tokens} asked for")
        chunks.append(torch.tensor(ids[pos : pos + chunk_len]))
        pos += chunk_len
    return chunks


def chat_chunks(tokenizer, generate: Generate, prompts: tuple[str, ...]) -> list[torch.Tensor]:
    chunks = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        chunks.append(torch.tensor(ids + generate(ids)))
    return chunks


def build(
    tokenizer, generate: Generate, tokens: int, chunk_len: int = 512, prompts: tuple[str, ...] = CHAT_PROMPTS
) -> list[torch.Tensor]:
    """Chat chunks first, then text until at least ``tokens`` positions are scored in all."""
    chat = chat_chunks(tokenizer, generate, prompts)
    scored = sum(len(c) - 1 for c in chat)
    return chat + text_chunks(tokenizer, max(0, tokens - scored), chunk_len)


def fingerprint(chunks: list[torch.Tensor]) -> str:
    d = hashlib.blake2b(digest_size=8)
    for c in chunks:
        d.update(c.numpy().astype("int64").tobytes())
        d.update(b"|")
    return d.hexdigest()
