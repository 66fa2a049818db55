"""Core chunks as OpenAI bodies: logprob formats, usage over several choices, finish reasons."""

from __future__ import annotations

import pytest

from kvmesh.api.common.v1 import accounting_pb2, sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import KvmeshError, Unavailable
from services.gateway.openai_render import ChatRenderer, CompletionRenderer, TokenTexts, finish_reason


class Texts:
    """A tokenizer whose token i reads "t<i>"; token 9 is half of a character."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("\ufffd" if i == 9 else f"t{i}" for i in ids)


def lp(token: int, logprob: float, *alternatives: tuple[int, float]) -> sampling_pb2.TokenLogprob:
    return sampling_pb2.TokenLogprob(
        token_id=token,
        logprob=logprob,
        top_logprobs=[sampling_pb2.TopLogprob(token_id=t, logprob=v) for t, v in alternatives],
    )


def chunk(
    tokens: list[int],
    text: str,
    logprobs=(),
    final: tuple[int, int, int] | None = None,
    reason: int = sampling_pb2.FINISH_REASON_STOP,
) -> gateway_pb2.GenerateResponse:
    """``final``: (prompt tokens, completion tokens, cached tokens)."""
    c = gateway_pb2.GenerateResponse(token_ids=tokens, text=text, logprobs=logprobs)
    if final is not None:
        prompt, completion, cached = final
        c.final.CopyFrom(
            gateway_pb2.StreamEnd(
                finish_reason=reason,
                usage=accounting_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
            )
        )
    return c


def chat_chunk(
    tokens: list[int],
    text: str,
    logprobs=(),
    final: tuple[int, int, int] | None = None,
    reason: int = sampling_pb2.FINISH_REASON_STOP,
    calls: tuple[tuple[str, str, str], ...] = (),
) -> gateway_pb2.ChatResponse:
    """``chunk``'s fields in a chat chunk, with ``calls`` as (id, name, arguments)."""
    c = gateway_pb2.ChatResponse.FromString(chunk(tokens, text, logprobs, final, reason).SerializeToString())
    for call_id, name, arguments in calls:
        c.tool_calls.add(id=call_id, name=name, arguments=arguments)
    return c


def renderer(cls, choices: int = 1, per_prompt: int = 1, logprobs: bool = True):
    return cls(
        "id-1", 100, "tiny", choices=choices, per_prompt=per_prompt, texts=TokenTexts(Texts()), logprobs=logprobs
    )


def test_completion_logprobs_in_the_legacy_format_with_running_offsets() -> None:
    r = renderer(CompletionRenderer)
    first = r.add(0, chunk([1, 22], "t1t22", [lp(1, -0.5, (1, -0.5), (3, -1.5)), lp(22, -float("inf"))]))
    last = r.add(0, chunk([3], "t3", [lp(3, -0.25, (3, -0.25))], final=(5, 3, 0)))

    assert first.choices[0].logprobs.model_dump() == {
        "tokens": ["t1", "t22"],
        "token_logprobs": [-0.5, -9999.0],  # -inf is not JSON: OpenAI's floor instead
        "top_logprobs": [{"t1": -0.5, "t3": -1.5}, {}],
        "text_offset": [0, 2],
    }
    assert last.choices[0].logprobs.text_offset == [5] and last.choices[0].finish_reason == "stop"
    whole = r.response().choices[0]
    assert whole.text == "t1t22t3" and whole.logprobs.tokens == ["t1", "t22", "t3"]
    assert whole.logprobs.text_offset == [0, 2, 5]


def test_chat_logprobs_carry_bytes_unless_a_token_is_part_of_a_character() -> None:
    r = renderer(ChatRenderer)
    piece = r.add(0, chat_chunk([1, 9], "t1", [lp(1, -0.1, (9, -2.0)), lp(9, -0.2)], final=(4, 2, 0)))

    content = piece.choices[0].logprobs.content
    assert [(c.token, c.bytes) for c in content] == [("t1", [116, 49]), ("\ufffd", None)]
    assert [(t.token, t.logprob, t.bytes) for t in content[0].top_logprobs] == [("\ufffd", -2.0, None)]
    assert r.response().choices[0].logprobs.content == content


def test_without_logprobs_requested_there_are_none() -> None:
    r = renderer(ChatRenderer, logprobs=False)
    piece = r.add(0, chat_chunk([1], "t1", final=(4, 1, 0)))

    assert piece.choices[0].logprobs is None and r.response().choices[0].logprobs is None


def test_chat_chunks_name_the_role_once_per_choice() -> None:
    r = renderer(ChatRenderer, choices=2, per_prompt=2, logprobs=False)
    roles = [r.add(i, chat_chunk([1], "x")).choices[0].delta.role for i in (0, 1, 0, 1)]

    assert roles == ["assistant", "assistant", None, None]


def test_tool_calls_go_out_in_the_chunk_that_completed_them_and_add_up_to_the_message() -> None:
    r = renderer(ChatRenderer, logprobs=False)
    chunks = [
        r.add(0, chat_chunk([1, 2], "Let me look.")),
        r.add(0, chat_chunk([3, 4], "", calls=(("call_a", "f", '{"x": 1}'),))),
        r.add(
            0,
            chat_chunk(
                [5], "", calls=(("call_b", "g", "{}"),), final=(4, 5, 0), reason=sampling_pb2.FINISH_REASON_TOOL_CALLS
            ),
        ),
    ]

    deltas = [c.choices[0].delta for c in chunks]
    assert [d.content for d in deltas] == ["Let me look.", None, None]
    assert [
        d.tool_calls and [(t.index, t.id, t.function.name, t.function.arguments) for t in d.tool_calls] for d in deltas
    ] == [None, [(0, "call_a", "f", '{"x": 1}')], [(1, "call_b", "g", "{}")]]
    [choice] = r.response().choices
    assert choice.finish_reason == chunks[-1].choices[0].finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert [(t.id, t.type, t.function.name) for t in choice.message.tool_calls] == [
        ("call_a", "function", "f"),
        ("call_b", "function", "g"),
    ]


def test_a_reply_of_calls_only_has_null_content_and_a_plain_reply_no_calls() -> None:
    calls_only = renderer(ChatRenderer, logprobs=False)
    calls_only.add(
        0,
        chat_chunk(
            [1], "", calls=(("call_a", "f", "{}"),), final=(4, 1, 0), reason=sampling_pb2.FINISH_REASON_TOOL_CALLS
        ),
    )
    plain = renderer(ChatRenderer, logprobs=False)
    plain.add(0, chat_chunk([1], "", final=(4, 1, 0)))

    assert calls_only.response().choices[0].message.content is None
    message = plain.response().choices[0].message
    assert message.content == "" and message.tool_calls is None


def test_usage_counts_each_prompt_once_and_its_least_cached_copy() -> None:
    r = renderer(CompletionRenderer, choices=4, per_prompt=2, logprobs=False)
    for index, (prompt, completion, cached) in enumerate([(10, 3, 8), (10, 4, 0), (20, 5, 16), (20, 6, 16)]):
        r.add(index, chunk([1] * completion, "x", final=(prompt, completion, cached)))

    usage = r.usage()
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (30, 18, 48)
    assert usage.prompt_tokens_details.cached_tokens == 16
    assert r.usage_chunk().choices == [] and r.usage_chunk().usage == usage


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (sampling_pb2.FINISH_REASON_STOP, "stop"),
        (sampling_pb2.FINISH_REASON_LENGTH, "length"),
        (sampling_pb2.FINISH_REASON_REPETITION, "length"),
        (sampling_pb2.FINISH_REASON_TOOL_CALLS, "tool_calls"),
    ],
)
def test_finish_reasons(reason, expected) -> None:
    assert finish_reason(reason) == expected


def test_an_aborted_or_failed_sequence_is_an_error_not_a_finish() -> None:
    with pytest.raises(Unavailable, match="aborted in the mesh"):
        finish_reason(sampling_pb2.FINISH_REASON_ABORT)
    with pytest.raises(KvmeshError, match="FINISH_REASON_ERROR"):
        finish_reason(sampling_pb2.FINISH_REASON_ERROR)


def test_token_texts_are_decoded_once() -> None:
    calls = []

    class Counting(Texts):
        def decode(self, ids, skip_special_tokens=True):
            calls.append(ids)
            return super().decode(ids, skip_special_tokens)

    texts = TokenTexts(Counting())
    assert [texts(5), texts(5), texts(6)] == ["t5", "t5", "t6"] and calls == [[5], [6]]


def test_system_fingerprint_is_the_decode_worker_s_on_the_ending_chunks_and_the_response() -> None:
    def ending(chunk_of, fingerprint: str):
        c = chunk_of([2], "t2", final=(4, 2, 0))
        c.final.system_fingerprint = fingerprint
        return c

    for cls, chunk_of in ((CompletionRenderer, chunk), (ChatRenderer, chat_chunk)):
        r = renderer(cls, choices=2)
        assert r.add(0, chunk_of([1], "t1")).system_fingerprint is None  # not known before a choice ends
        assert r.add(0, ending(chunk_of, "")).system_fingerprint is None  # prefill finished it: no decode worker
        assert r.add(1, ending(chunk_of, "fp_0123456789ab")).system_fingerprint == "fp_0123456789ab"
        assert r.usage_chunk().system_fingerprint == "fp_0123456789ab"
        assert r.response().system_fingerprint == "fp_0123456789ab"
