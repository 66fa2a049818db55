"""``kvmesh generate``: the engine alone from the command line, free or constrained."""

from __future__ import annotations

import json
import re

from kvmesh.cli import main
from kvmesh.engine.tokenizer import Tokenizer


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_with_token_ids_and_finish_reason(llama_with_tokenizer, capsys):
    code, out, _ = _run(
        capsys, "--model", str(llama_with_tokenizer), "--prompt", "def f(x):", "--max-tokens", "5", "--json"
    )
    result = json.loads(out)
    assert code == 0 and len(result["token_ids"]) <= 5 and result["finish_reason"] in ("stop", "length")


def test_two_ranks_through_either_all_reduce_generate_one_rank_s_tokens(llama_with_tokenizer, capsys):
    argv = ["--model", str(llama_with_tokenizer), "--prompt", "def f(x):", "--max-tokens", "8", "--json"]
    runs = [_run(capsys, *argv, *extra) for extra in ([], ["--tensor-parallel-size", "2"])]
    runs.append(_run(capsys, *argv, "--tensor-parallel-size", "2", "--tp-all-reduce", "gloo"))
    assert [code for code, _, _ in runs] == [0, 0, 0]
    tokens = [json.loads(out)["token_ids"] for _, out, _ in runs]
    assert tokens[0] == tokens[1] == tokens[2] and tokens[0]


def test_a_json_schema_constrains_the_output(llama_with_tokenizer, capsys):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    code, out, _ = _run(
        capsys,
        "--model",
        str(llama_with_tokenizer),
        "--prompt",
        "x = ",
        "--max-tokens",
        "40",
        "--json",
        "--json-schema",
        json.dumps(schema),
    )
    result = json.loads(out)
    assert code == 0 and result["finish_reason"] == "stop"
    assert 0 <= json.loads(result["text"])["n"] <= 99


def test_a_regex_constrains_the_output(llama_with_tokenizer, capsys):
    code, out, _ = _run(
        capsys,
        "--model",
        str(llama_with_tokenizer),
        "--prompt",
        "x = ",
        "--max-tokens",
        "40",
        "--json",
        "--regex",
        "[a-z]{3}-[0-9]{2}",
    )
    assert code == 0 and re.fullmatch("[a-z]{3}-[0-9]{2}", json.loads(out)["text"])


def test_an_unenforceable_schema_is_a_clear_error(llama_with_tokenizer, capsys):
    code, _, err = _run(
        capsys, "--model", str(llama_with_tokenizer), "--prompt", "x", "--json-schema", '{"not": {"type": "string"}}'
    )
    assert code == 2 and "keyword 'not' is not supported" in err


def test_lora_generates_what_transformers_and_peft_do(llama_with_tokenizer, tmp_path, capsys):
    from .peft_reference import ADAPTERS, peft_greedy, write_peft_adapter

    adapter = write_peft_adapter(llama_with_tokenizer, tmp_path / "qv", 0, **ADAPTERS["qv"])
    argv = ["--model", str(llama_with_tokenizer), "--prompt", "def f(x):", "--max-tokens", "8", "--json"]
    code, out, _ = _run(capsys, *argv, "--lora", str(adapter))
    result = json.loads(out)
    _, base, _ = _run(capsys, *argv)
    ids = Tokenizer(llama_with_tokenizer).encode("def f(x):", add_special_tokens=True)
    expected, _ = peft_greedy(llama_with_tokenizer, adapter, ids, len(result["token_ids"]))
    assert code == 0 and result["token_ids"] == expected
    assert json.loads(base)["token_ids"] != result["token_ids"]
