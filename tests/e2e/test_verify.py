"""``kvmesh verify`` against our own mesh (real processes): the served bf16 model and a served fp8
checkpoint pass against transformers on their weights; a deliberately broken plan (everything,
LM head included, in NVFP4) fails against the original model, naming the checks that failed.
The last test does the same on the real default model: its fp8 plan passes against the original."""

from __future__ import annotations

import pytest

from kvmesh.checkpoint.compressed import linear_modules, write_checkpoint
from kvmesh.checkpoint.files import iter_tensors, weight_files
from kvmesh.cli import main
from kvmesh.engine.default_model import default_model_path
from tests.e2e.mesh_helpers import http_url, start_mesh

pytestmark = pytest.mark.timeout(600)


def _plan(src, fmt: str, head: bool = False) -> dict[str, str]:
    plan = {m: fmt for m in linear_modules([n for n, _ in iter_tensors(weight_files(src))])}
    return {**plan, "lm_head": fmt} if head else plan


def _verify(capsys, model, golden, run_dir, *flags: str) -> tuple[int, str]:
    """Serve ``model`` on a fresh mesh and verify it against transformers on ``golden``."""
    mesh = start_mesh(model, run_dir)
    try:
        rc = main(["verify", "--endpoint", http_url(mesh), "--model", str(golden), *flags])
    finally:
        mesh.stop()
    return rc, capsys.readouterr().out


def _result(out: str, check: str) -> str:
    """PASS or FAIL of the table row naming ``check``."""
    row = next(line for line in out.splitlines() if line.startswith(check))
    return "PASS" if " PASS " in row else "FAIL"


def test_our_mesh_passes_against_transformers(mesh, e2e_model, capsys):
    rc = main(["verify", "--endpoint", http_url(mesh), "--model", str(e2e_model), "--min-agreement", "1.0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "6/6 identical" in out and "FAIL" not in out and out.rstrip().endswith("PASS")


def test_a_served_fp8_checkpoint_passes_and_a_broken_plan_fails(e2e_model, tmp_path, capsys):
    fp8 = write_checkpoint(e2e_model, tmp_path / "fp8" / "llama", _plan(e2e_model, "fp8-channel"))
    broken = write_checkpoint(e2e_model, tmp_path / "broken" / "llama", _plan(e2e_model, "nvfp4", head=True))
    rc, out = _verify(capsys, fp8, fp8, tmp_path / "run-fp8", "--min-agreement", "1.0")  # same weights: exact
    assert rc == 0, out
    rc, out = _verify(capsys, broken, e2e_model, tmp_path / "run-broken")
    assert rc == 1, out
    assert _result(out, "greedy agreement") == "FAIL" and _result(out, "KL(golden||served)") == "FAIL"
    assert "FAIL: greedy agreement" in out and "diverged at token" in out
    # The API contract still holds: only fidelity failed.
    for check in ("temperature < 0 -> 400", "unknown tool", "usage.prompt_tokens exact", "tool call valid"):
        assert _result(out, check) == "PASS", out


@pytest.mark.slow
def test_the_default_models_fp8_plan_served_passes_against_the_original(tmp_path, capsys):
    src = default_model_path()
    fp8 = write_checkpoint(src, tmp_path / "smollm2-fp8", _plan(src, "fp8-channel"))
    rc, out = _verify(capsys, fp8, src, tmp_path / "run")
    assert rc == 0, out
