"""The TypeScript client (clients/typescript): strict type check clean, and its tests pass against a live mesh."""

from __future__ import annotations

import re

import pytest

from tests.clients.toolchain import ROOT, require_tool, run

pytestmark = pytest.mark.timeout(600)
TS = ROOT / "clients" / "typescript"


@pytest.fixture(scope="module")
def built() -> None:
    """Compiles src/, test/ and examples/ to dist/ (which node runs)."""
    run([require_tool("npx"), "--no-install", "tsc", "-p", "."], TS)


def test_tsc_strict_no_emit():
    run([require_tool("npx"), "--no-install", "tsc", "--noEmit", "--strict", "-p", "."], TS)


def test_ts_client_against_mesh(built, client_env):
    out = run([require_tool("node"), "--test", "dist/test/client.test.js"], TS, env=client_env)
    # Every test ran (the suite skips itself without a mesh), none failed.
    assert re.search(r"^# skipped 0$", out, re.M), out
    assert re.search(r"^# fail 0$", out, re.M), out
    assert int(re.search(r"^# pass (\d+)$", out, re.M).group(1)) >= 4, out


def test_example_script_streams_a_completion(built, client_env):
    out = run([require_tool("node"), "dist/examples/generate.js", "hello"], TS, env={**client_env, "MAX_TOKENS": "5"})
    assert re.search(r"completion tokens: [1-5]\b", out), out
