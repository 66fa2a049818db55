"""Quantized checkpoints: the compressed-tensors layout, the engine loading them (greedy identical
to transformers on the dequantized weights), and ``kvmesh quantize`` end to end on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.checkpoint.compressed import load_hf_model, read_plan, state_dict, write_checkpoint
from kvmesh.checkpoint.files import iter_tensors, weight_files
from kvmesh.checkpoint.formats import fake_quantize
from kvmesh.cli import main
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from tests.e2e.mesh_helpers import write_model
from tests.engine.conftest import write_checkpoint as write_hf

PROMPT = [3, 14, 15, 92, 65]


def _greedy_engine(path, n=16) -> list[int]:
    engine = LLMEngine(path, EngineConfig(num_blocks=16))
    return engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids


def _greedy_hf(path, n=16) -> list[int]:
    model = load_hf_model(path)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def _mixed_plan(src) -> dict[str, str]:
    names = [n for n, _ in iter_tensors(weight_files(src))]
    mods = sorted({n.rsplit(".", 1)[0] for n in names if "_proj" in n})
    fmts = ["fp8-tensor", "fp8-channel", "int8-channel", "nvfp4"]
    return {m: fmts[i % 4] for i, m in enumerate(mods)}


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen3-qknorm-tied"])
def test_the_engine_serves_a_mixed_checkpoint_exactly_as_its_dequantized_weights(tmp_path, arch):
    src = write_hf(tmp_path / "src", arch)
    plan = _mixed_plan(src)
    out = write_checkpoint(src, tmp_path / "q", plan)
    assert _greedy_engine(out) == _greedy_hf(out)
    # The stored weights are the formats' own: dequantized they equal fake quantization of the original.
    original, loaded = state_dict(src), state_dict(out)
    for m, fmt in plan.items():
        assert torch.equal(loaded[f"{m}.weight"], fake_quantize(fmt, original[f"{m}.weight"].float()))


def test_the_compressed_tensors_layout(tmp_path):
    src = write_hf(tmp_path / "src", "llama-gqa")
    out = write_checkpoint(src, tmp_path / "q", {"model.layers.0.mlp.down_proj": "nvfp4",
                                                 "model.layers.1.self_attn.q_proj": "fp8-channel"})  # fmt: skip
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    groups = {g["format"]: g for g in qc["config_groups"].values()}
    assert groups["nvfp4-pack-quantized"]["weights"]["group_size"] == 16
    assert groups["float-quantized"]["weights"]["strategy"] == "channel"
    assert "lm_head" in qc["ignore"] and "model.layers.0.mlp.up_proj" in qc["ignore"]
    names = {n: t for n, t in iter_tensors(weight_files(out))}
    assert names["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.uint8
    assert names["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert names["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert read_plan(json.loads((out / "config.json").read_text()), list(names)) == {
        "model.layers.0.mlp.down_proj": "nvfp4",
        "model.layers.1.self_attn.q_proj": "fp8-channel",
    }


def test_a_tied_head_in_the_plan_quantizes_the_embedding(tmp_path):
    src = write_hf(tmp_path / "src", "llama-mha-tied")
    out = write_checkpoint(src, tmp_path / "q", {"lm_head": "nvfp4"})
    names = [n for n, _ in iter_tensors(weight_files(out))]
    assert "model.embed_tokens.weight_packed" in names and "model.embed_tokens.weight" not in names
    assert _greedy_engine(out) == _greedy_hf(out)


def test_kvmesh_quantize_writes_the_checkpoint_and_fidelity_json(tmp_path, capsys):
    src = write_model(tmp_path / "m" / "llama")
    out = tmp_path / "q"
    rc = main(["quantize", "--model", str(src), "--format", "int8-channel", "--out", str(out),
               "--eval-tokens", "300", "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "fidelity.json").read_text())
    assert report["eval_tokens"] >= 300 and report["config"] == "int8-channel"
    for key in ("kl_mean", "kl_p99", "kl_max", "same_top1", "rms_dp", "ppl_ratio", "kl_mean_ci95", "same_top1_ci95"):
        assert key in report["fidelity"] and key in report["noise_floor"]
    assert 0 < report["fidelity"]["kl_mean"] and report["fidelity"]["bits"] == 8.0
    printed = capsys.readouterr().out
    assert "bf16 vs fp32 (noise floor)" in printed and "int8-channel" in printed
    assert (out / "tokenizer.json").is_file() and _greedy_engine(out) == _greedy_hf(out)


def test_kvmesh_quantize_searches_a_plan_under_a_budget(tmp_path, capsys):
    src = write_model(tmp_path / "m" / "llama")
    out = tmp_path / "q"
    rc = main(["quantize", "--model", str(src), "--plan", "auto", "--budget-bits", "6", "--out", str(out),
               "--layers-per-group", "1", "--search-chunks", "3", "--max-trials", "2",
               "--eval-tokens", "300", "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "fidelity.json").read_text())
    assert report["fidelity"]["bits"] <= 6.0
    budget = report["search"]["budgets"]["6.0"]
    assert budget["trials"][0]["move"] == "additive plan" and len(budget["trials"]) == 3
    assert set(report["search"]["sensitivity"]) == {f"L{i}-{i}.{k}:{f}" for i in (0, 1) for k in ("attn", "mlp")
                                                   for f in ("fp8-channel", "nvfp4")}  # fmt: skip
    assert "measured KL" in capsys.readouterr().out
