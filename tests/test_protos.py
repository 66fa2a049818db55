"""The contracts: generated code is importable and current, and buf lint is clean."""

from __future__ import annotations

import filecmp
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import grpc_tools
import pytest

REPO = Path(__file__).resolve().parents[1]
PROTOS = REPO / "protos"
SERVICES = {
    "gateway": "GatewayService",
    "router": "RouterService",
    "prefill": "PrefillService",
    "decode": "DecodeService",
    "kvstore": "KVStoreService",
    "speculator": "SpeculatorService",
}


def _proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_generated_service_imports(name: str) -> None:
    pb2 = importlib.import_module(f"kvmesh.api.{name}.v1.{name}_pb2")
    pb2_grpc = importlib.import_module(f"kvmesh.api.{name}.v1.{name}_pb2_grpc")
    service = pb2.DESCRIPTOR.services_by_name[SERVICES[name]]
    assert service.full_name == f"kvmesh.api.{name}.v1.{SERVICES[name]}"
    assert hasattr(pb2_grpc, f"{SERVICES[name]}Stub")
    assert hasattr(pb2_grpc, f"add_{SERVICES[name]}Servicer_to_server")
    # Each RPC has its own request and response messages.
    for method in service.methods:
        assert method.input_type.name == f"{method.name}Request"
        assert method.output_type.name == f"{method.name}Response"


def test_common_types_round_trip() -> None:
    from kvmesh.api.common.v1 import kv_pb2, sampling_pb2

    chunk = kv_pb2.KVBlockChunk(block_hash=b"\x01" * 16, chunk_index=1, num_chunks=3, data=b"xyz")
    assert kv_pb2.KVBlockChunk.FromString(chunk.SerializeToString()) == chunk
    params = sampling_pb2.SamplingParams(max_tokens=5)
    assert not params.HasField("temperature")  # unset means 1.0, distinct from greedy 0.0
    params.temperature = 0.0
    assert params.HasField("temperature")


def test_generated_code_is_current(tmp_path: Path) -> None:
    """What protoc makes from protos/ now is byte-identical to the checked-in kvmesh/api/*/v1 files."""
    wkt = Path(grpc_tools.__file__).parent / "_proto"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"-I{wkt}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *_proto_files(),
        ],
        check=True,
        cwd=PROTOS,
    )
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    checked_in = sorted(p.relative_to(REPO) for p in (REPO / "kvmesh" / "api").glob("*/v1/*_pb2*.py*"))
    assert fresh == checked_in, "generated files differ from protos/: run `make gen`"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, REPO / p, shallow=False)]
    assert not stale, f"stale generated code {stale}: run `make gen`"


@pytest.mark.skipif(shutil.which("npx") is None, reason="node/npx not installed")
def test_buf_lint() -> None:
    if not (REPO / "node_modules" / ".bin" / "buf").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=REPO, check=True)
    result = subprocess.run(["npx", "--no-install", "buf", "lint", "protos"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
