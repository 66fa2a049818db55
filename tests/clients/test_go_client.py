"""The Go client (clients/go): vet clean, and its tests pass against a live mesh."""

from __future__ import annotations

import re

import pytest

from tests.clients.toolchain import ROOT, require_tool, run

pytestmark = pytest.mark.timeout(600)
GO = ROOT / "clients" / "go"


def test_go_vet():
    run([require_tool("go"), "vet", "./..."], GO)


def test_go_client_against_mesh(client_env):
    # -count=1: never a cached result, the mesh is new every run.
    out = run([require_tool("go"), "test", "-count=1", "-v", "./..."], GO, env=client_env)
    # None skipped: the suite saw the mesh.
    assert "--- SKIP" not in out, out
    passed = set(re.findall(r"--- PASS: (\w+)", out))
    assert {
        "TestGenerateStreamsIncrementallyAndEndsWithUsage",
        "TestCancelledContextStopsTheStreamAndFreesTheRequest",
        "TestWrongAPIKeyIsUnauthenticated",
    } <= passed, out


def test_example_command_streams_a_completion(client_env):
    out = run(
        [require_tool("go"), "run", "./cmd/kvmesh-generate", "-addr", client_env["KVMESH_GATEWAY_ADDRESS"],
         "-api-key", client_env["KVMESH_API_KEY"], "-prompt", "hello", "-max-tokens", "5"],
        GO,
        env=client_env,
    )
    assert re.search(r"completion tokens: [1-5]\b", out), out
