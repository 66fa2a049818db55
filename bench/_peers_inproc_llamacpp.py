"""llama.cpp in-process for bench/peers.py: batched greedy decoding through the ctypes binding of the same sdist.

"In-process" for llama.cpp means: one context, the prompts as sequences 0..N-1 of one ``llama_batch`` (all
prompts prefilled in one ``llama_decode``), then one ``llama_decode`` per step with every sequence's last
token, greedy argmax of each sequence's logits. That is the loop ``llama-server`` and ``llama-batched`` run,
called from Python against the same libllama the server is linked with (llama-cpp-python's high-level
``Llama`` class decodes one sequence at a time, so it is not used). The KV cache is cleared before every call,
so nothing is reused between runs. Runs in the llama.cpp venv (LLAMA_CPP_LIB_PATH and PYTHONPATH from
bench/_peers_install.py). Run: ``python bench/_peers_inproc_llamacpp.py MODEL.gguf THREADS N_CTX REPACK``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_worker import serve  # noqa: E402


def main() -> None:
    import llama_cpp as L

    gguf, threads, n_ctx, repack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    max_seqs = 16
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = repack  # off = --no-repack (the Q4_1 AMX repacked kernel dies with SIGILL here)
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = n_ctx, max_seqs, threads, threads
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(cp.n_batch, 0, max_seqs)

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)

    def argmax(i: int) -> int:
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        return int(logits.argmax())

    def generate(prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        entries = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        last_rows, row = [], -1
        for p in prompts:
            row += len(p)
            last_rows.append(row)
        fill(entries)  # every prompt token in one decode: n_batch (2048 by default) holds them all
        if L.llama_decode(ctx, batch):
            raise RuntimeError("llama_decode failed on the prompts")
        out = [[argmax(r)] for r in last_rows]
        for step in range(1, n):
            fill([(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, out))])
            if L.llama_decode(ctx, batch):
                raise RuntimeError("llama_decode failed on a decode step")
            for s, o in enumerate(out):
                o.append(argmax(s))
        return time.perf_counter() - t0, out

    generate([[1, 2, 3, 4, 5, 6, 7, 8]], 2)
    serve(generate)


if __name__ == "__main__":
    main()
