"""The EAGLE head's corpus: openings of code and instructions the target answers itself.

The benchmark's prompts stay held out; the code openings are seeded; and a head
trains end to end on the target's own continuations of code (``--data code``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvmesh.training import eagle as train_eagle
from kvmesh.training.eagle_corpus import code_prompts, instruction_prompts
from tests.engine.conftest import llama_with_tokenizer, tokenizer_files  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import speculation as bench_speculation  # noqa: E402


def test_no_benchmark_prompt_is_a_training_prompt():
    train = set(instruction_prompts()) | set(code_prompts(2000, seed=0))
    held_out = bench_speculation.CODE + bench_speculation.CHAT + bench_speculation.PROSE
    assert not train & set(held_out)


def test_instruction_prompts_are_distinct():
    prompts = instruction_prompts()
    assert len(prompts) == len(set(prompts)) > 500


def test_code_openings_are_seeded_and_start_at_a_definition_or_a_file():
    a, b, c = code_prompts(300, seed=0), code_prompts(300, seed=0), code_prompts(300, seed=1)
    assert a == b and a != c and len(a) == 300
    starts = [p.lstrip().split(None, 1)[0] for p in a]
    assert sum(s in ("def", "class", "async") for s in starts) > 0.7 * len(a)


def test_a_head_trains_on_the_targets_own_continuations_of_code(llama_with_tokenizer, tmp_path):  # noqa: F811
    out = tmp_path / "head"
    rc = train_eagle.main(
        [
            "--model",
            str(llama_with_tokenizer),
            "--data",
            "code",
            "--code-prompts",
            "12",
            "--code-tokens",
            "24",
            "--out",
            str(out),
            "--cache",
            str(tmp_path / "cache"),
            "--intermediate",
            "64",
            "--draft-vocab",
            "256",
            "--unroll",
            "2",
            "--epochs",
            "2",
            "--batch",
            "32",
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    # 12 openings, each followed by up to 24 tokens the target wrote (fewer where it ended early).
    assert cfg["training"]["windows"] == 12
    assert cfg["training"]["tokens"] > 12 * 4
    chain = cfg["training"]["heldout_chain_agreement_per_step"]
    assert len(chain) == 2 and 1.0 >= chain[0] >= chain[1] >= 0.0  # a chain can only die as it grows
    assert cfg["training"]["heldout_expected_accepted_length"] == round(1 + sum(chain), 3)
    (corpus,) = (tmp_path / "cache").glob("corpus-*.pt")
    (features,) = set((tmp_path / "cache").iterdir()) - {corpus}
    assert sum(map(len, torch.load(corpus))) == torch.load(features)["labels"].numel() == cfg["training"]["tokens"]


def test_features_for_other_layers_reuse_the_cached_corpus(llama_with_tokenizer, tmp_path, capsys):  # noqa: F811
    flags = [
        "--model",
        str(llama_with_tokenizer),
        "--data",
        "code",
        "--code-prompts",
        "6",
        "--code-tokens",
        "16",
        "--cache",
        str(tmp_path / "cache"),
        "--intermediate",
        "32",
        "--draft-vocab",
        "128",
        "--unroll",
        "2",
        "--epochs",
        "1",
        "--batch",
        "16",
        "--threads",
        "1",
    ]
    assert train_eagle.main([*flags, "--out", str(tmp_path / "a")]) == 0
    assert "target wrote" in capsys.readouterr().err
    assert train_eagle.main([*flags, "--out", str(tmp_path / "b"), "--feature-layers", "0,1"]) == 0
    err = capsys.readouterr().err
    assert "corpus: cached" in err and "target wrote" not in err
    data = torch.load(
        next(
            p
            for p in (tmp_path / "cache").iterdir()
            if not p.name.startswith("corpus-") and "layer_features" in torch.load(p)
        )
    )
    assert data["layer_features"].shape == (data["features"].shape[0], 2 * data["features"].shape[1])
    assert json.loads((tmp_path / "b" / "config.json").read_text())["head"]["feature_layers"] == [0, 1]
