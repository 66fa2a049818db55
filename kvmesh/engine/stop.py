"""When a sequence finishes, and how much of its text may be streamed yet.

Stop strings are matched on the decoded text and are not part of the output
(unless the request includes them). While the text ends with the beginning of
a stop string, that tail is held back: streaming it and then finding the stop
would have leaked it. Until ``min_tokens`` tokens are out, nothing but the
length ends a sequence (its end tokens are masked: ``kvmesh.engine.penalties``).
"""

from __future__ import annotations

from collections.abc import Set

from kvmesh.engine.sequence import Sequence
from kvmesh.engine.stop_strings import stop_cut


def check_stop(seq: Sequence, token: int, eos_ids: Set[int], max_model_len: int) -> str | None:
    """The finish reason after ``token`` was appended, or None to go on."""
    p = seq.params
    early = len(seq.output_ids) < p.min_tokens
    if not early and ((not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids):
        return "stop"
    if not early and p.stop and seq.detok is not None and _truncate_at_stop(seq):
        return "stop"
    if seq.grammar is not None and seq.grammar.is_terminated():
        return "stop"  # the grammar is complete (its stop token was accepted, even with ignore_eos)
    if p.repetition_limit and token not in p.repetition_allow and _trailing_run(seq.output_ids) > p.repetition_limit:
        return "repetition"
    if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _trailing_run(ids: list[int]) -> int:
    last, n = ids[-1], 0
    for t in reversed(ids):
        if t != last:
            break
        n += 1
    return n


def _truncate_at_stop(seq: Sequence) -> bool:
    text = seq.detok.text
    longest = max(len(s) for s in seq.params.stop)
    # Only text that is new or could complete a stop with new text needs searching.
    window = max(0, seq.emitted_text_len - longest + 1)
    cut = stop_cut(text, seq.params.stop, window, seq.params.include_stop_str_in_output)
    if cut is None:
        return False
    seq.detok.text = text[:cut]
    return True


def releasable_text(seq: Sequence, finished: bool) -> str:
    """The text that can be handed out now, beyond what already was."""
    if seq.detok is None:
        return ""
    text = seq.detok.text
    end = len(text)
    if not finished:
        for s in seq.params.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    end = min(end, len(text) - k)
                    break
    return text[seq.emitted_text_len : max(end, seq.emitted_text_len)]
