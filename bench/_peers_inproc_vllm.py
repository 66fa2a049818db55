"""vLLM in-process for bench/peers.py: ``LLM.generate`` on token-id prompts, greedy, EOS ignored.

Runs in the vLLM venv (no kvmesh imports). No prefix caching, as for kvmesh's in-process engine: every
call computes its prompts. Run: ``python bench/_peers_inproc_vllm.py MODEL_DIR DTYPE``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_worker import serve  # noqa: E402


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], enable_prefix_caching=False, seed=0)

    def generate(prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate([[1, 2, 3, 4, 5, 6, 7, 8]], 2)
    serve(generate)


if __name__ == "__main__":
    main()
