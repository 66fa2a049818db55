"""The durations report: a run with ``--durations-json`` names each test's phases and each fixture's setup,
on one runner and across xdist runners, and the renderer turns it into the tables docs/test-durations.md has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.test_durations import render

REPO = Path(__file__).resolve().parents[1]

SUITE = """
import time
import pytest

@pytest.fixture(scope="session")
def slow_start():
    time.sleep(0.3)
    return 1

@pytest.fixture
def quick():
    return 2

def test_uses_the_slow_start(slow_start, quick):
    time.sleep(0.1)

def test_uses_it_again(slow_start):
    pass

def test_fails():
    assert False
"""


@pytest.mark.parametrize("runners", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one-runner", "xdist"])
def test_a_run_names_every_phase_and_the_fixture_that_cost_its_setup(tmp_path, runners) -> None:
    (tmp_path / "test_demo.py").write_text(SUITE)
    out = tmp_path / "durations.json"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.durations", "--durations-json", str(out), *runners]
    run = subprocess.run([*argv, str(tmp_path / "test_demo.py")], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout[-2000:]  # the one failing test, and nothing else
    report = json.loads(out.read_text())
    tests = {t["nodeid"].split("::")[-1]: t for t in report["tests"]}
    assert set(tests) == {"test_uses_the_slow_start", "test_uses_it_again", "test_fails"}
    assert tests["test_fails"]["outcome"] == "failed" and tests["test_uses_it_again"]["outcome"] == "passed"
    assert tests["test_uses_the_slow_start"]["call"] >= 0.1
    assert all({"setup", "call", "teardown"} <= t.keys() for t in tests.values())
    (slow,) = [f for f in report["fixtures"] if f["fixture"].endswith("::slow_start")]
    assert slow["scope"] == "session" and slow["seconds"] >= 0.3
    assert slow["test"].endswith("::test_uses_the_slow_start")
    assert report["workers"] == (2 if runners else 1)

    text = render(report)
    assert "test_demo.py` | 3 |" in text  # the file's row (its path is relative to wherever pytest put the root)
    assert "::slow_start` | session | 1x |" in text
    assert "## The 20 slowest tests" in text
