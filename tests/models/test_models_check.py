"""``kvmesh models check PATH``: passes a model kvmesh serves as transformers does (a small random Llama
with the default model's tokenizer and chat template), fails one whose config asks for maths kvmesh does
not implement, naming the field, and one whose tokenizer loses the text."""

from __future__ import annotations

import json
import shutil

import pytest

from kvmesh.cli import main
from kvmesh.engine.default_model import default_model_path

from ..engine.conftest import write_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Random-init weights in the default model's vocabulary, with its tokenizer and chat template."""
    path = write_checkpoint(tmp_path_factory.mktemp("check") / "m", "llama-gqa", vocab_size=49152)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_path() / name, path / name)
    return path


def test_a_served_model_passes_every_check(model, capsys) -> None:
    rc = main(["models", "check", str(model)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for check in (
        "architecture",
        "KV cache",
        "config fields",
        "chat template",
        "tokenizer round-trip",
        "greedy vs transformers",
    ):
        row = next(line for line in out.splitlines() if line.startswith(check))
        assert " PASS " in row, row
    assert "4/4 x 16" in out and out.rstrip().endswith("PASS")


def test_a_config_option_we_do_not_implement_fails_naming_the_field(model, tmp_path, capsys) -> None:
    bad = tmp_path / "gelu"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    assert main(["models", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "hidden_act='gelu' is not served" in out and "FAIL" in out


def test_a_tokenizer_that_does_not_give_the_text_back_fails_its_round_trip(model, tmp_path, capsys) -> None:
    """Its normalizer lowercases: the ids no longer decode to the text a user sent."""
    broken = tmp_path / "tok"
    shutil.copytree(model, broken)
    tok = json.loads((broken / "tokenizer.json").read_text())
    tok["normalizer"] = {"type": "Lowercase"}
    (broken / "tokenizer.json").write_text(json.dumps(tok))
    rc = main(["models", "check", str(broken), "--max-tokens", "4"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tokenizer round-trip"))
    assert rc == 1 and " FAIL " in row, out
