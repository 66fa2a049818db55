"""The suite's runners: a session fixture that starts processes is set up once however many files use it,
and a module's tests share one runner, under ``-n 2 --dist loadgroup``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
import os
import pytest

@pytest.fixture(scope="session")
def mesh():
    with open(os.environ["STARTS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return os.getpid()
"""

USES_MESH = """
import os
def test_{name}_a(mesh):
    assert mesh == os.getpid()
def test_{name}_b(mesh):
    assert mesh == os.getpid()
"""

MODULE = """
import os
import pytest

@pytest.fixture(scope="module")
def module_start():
    with open(os.environ["STARTS"] + ".modules", "a") as f:
        f.write(f"{__name__}\\n")

@pytest.mark.parametrize("i", range(6))
def test_one_runner(module_start, i):
    pass
"""


def test_a_shared_mesh_starts_once_and_a_module_stays_on_one_runner(tmp_path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("alpha", "beta", "gamma"):
        (suite / f"test_{name}.py").write_text(USES_MESH.format(name=name))
        (suite / f"test_{name}_module.py").write_text(MODULE)
    starts = tmp_path / "starts"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.xdist_groups", "-n", "2", "--dist", "loadgroup"]
    run = subprocess.run(
        [*argv, str(suite)], cwd=REPO, capture_output=True, text=True, env={**os.environ, "STARTS": str(starts)}
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert "24 passed" in run.stdout
    assert len(starts.read_text().split()) == 1  # one setup of the session fixture, for six tests in three files
    modules = Path(f"{starts}.modules").read_text().split()
    assert sorted(modules) == sorted(set(modules)) and len(modules) == 3  # each module's fixture once
