"""Mutual TLS on a real mesh (the default one ``kvmesh up`` runs): every internal port refuses a caller
without a certificate, with one no mesh CA signed, and with a valid one of a role the method does not
admit; the public gateway API stays reachable in plaintext."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.api.kvstore.v1 import kvstore_pb2  # noqa: F401  (loads its descriptors)
from kvmesh.api.prefill.v1 import prefill_pb2  # noqa: F401
from kvmesh.api.router.v1 import router_pb2  # noqa: F401
from kvmesh.api.speculator.v1 import speculator_pb2  # noqa: F401
from kvmesh.launcher.supervisor import Mesh
from kvmesh.runtime import create_channel
from kvmesh.runtime.authz import CALLERS, PUBLIC
from kvmesh.runtime.certs import self_signed
from kvmesh.runtime.identity import ROLES
from kvmesh.runtime.tls import TlsFiles

# The first method of each service's table entry, called on each internal process.
INTERNAL = {
    "router": "kvmesh.api.router.v1.RouterService",
    "kvstore": "kvmesh.api.kvstore.v1.KVStoreService",
    "speculator": "kvmesh.api.speculator.v1.SpeculatorService",
    "prefill-0": "kvmesh.api.prefill.v1.PrefillService",
    "decode-0": "kvmesh.api.decode.v1.DecodeService",
}


async def _code(address: str, identity: TlsFiles | None, service: str, method: str) -> tuple[grpc.StatusCode, str]:
    """``method`` called with an empty message, whatever its kind: the server admits or refuses the caller
    before it looks at the request."""
    desc = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(method)
    path = f"/{service}/{method}"
    async with create_channel(address, identity) as channel:
        try:
            if desc.client_streaming:
                make = channel.stream_stream if desc.server_streaming else channel.stream_unary
                # No message, only the end of the stream: a message written while the server refuses the
                # call races its status (grpc then reports INTERNAL "Internal error from Core").
                call = make(path)(timeout=10)
                with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                    await call.done_writing()
            else:
                make = channel.unary_stream if desc.server_streaming else channel.unary_unary
                call = make(path)(b"", timeout=10)
            if desc.server_streaming:
                async for _ in call:
                    pass
            else:
                await call
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def _health(address: str, identity: TlsFiles | None) -> grpc.StatusCode:
    async with create_channel(address, identity) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory, mesh: Mesh) -> dict[str, TlsFiles]:
    """Per role, a certificate that names the role but that the attacker signed itself."""
    folder: Path = tmp_path_factory.mktemp("forged")
    out = {}
    for role in ROLES:
        cert, key = self_signed(role)
        (folder / f"{role}.pem").write_bytes(cert)
        (folder / f"{role}.key").write_bytes(key)
        out[role] = TlsFiles(mesh.identity(role).ca, folder / f"{role}.pem", folder / f"{role}.key")
    return out


@pytest.mark.parametrize("process", list(INTERNAL))
async def test_every_internal_port_refuses_outsiders_and_wrong_roles(mesh: Mesh, forged, process: str) -> None:
    service = INTERNAL[process]
    address = mesh.address(process)
    # No certificate (plaintext), or any role's name on a certificate no mesh CA signed: the handshake
    # fails, so no call reaches the port at all (the health service's, here).
    for role in ("plaintext", *ROLES):
        who = None if role == "plaintext" else forged[role]
        assert (await _health(address, who)) == grpc.StatusCode.UNAVAILABLE, role
    assert (await _health(address, mesh.identity("operator"))) == grpc.StatusCode.OK
    for method, roles in CALLERS[service].items():
        allowed = sorted(roles)
        # A real mesh certificate of a role the method does not admit: refused by name.
        for role in sorted(set(ROLES) - roles):
            code, details = await _code(address, mesh.identity(role), service, method)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, role, code, details)
            assert f"role '{role}'" in details and f"{service}/{method}" in details
        # The admitted role gets past the check (its empty request then meets the method's own validation).
        code, details = await _code(address, mesh.identity(allowed[0]), service, method)
        assert code != grpc.StatusCode.PERMISSION_DENIED and code != grpc.StatusCode.UNAVAILABLE, (method, details)


async def test_a_worker_cannot_name_a_tenant_straight_to_decode(mesh: Mesh) -> None:
    """The cache salt is honoured only from the gateway: a decode worker's own certificate cannot call Decode."""
    request = decode_pb2.DecodeRequest(request_id="probe", prompt_token_ids=[1, 2, 3], cache_salt=b"tenant-a")
    async with create_channel(mesh.address("decode-0"), mesh.identity("decode")) as channel:
        call = channel.unary_stream("/kvmesh.api.decode.v1.DecodeService/Decode")(request.SerializeToString())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_the_public_gateway_api_is_plaintext_behind_its_own_keys(mesh: Mesh) -> None:
    assert CALLERS["kvmesh.api.gateway.v1.GatewayService"] == PUBLIC
    async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
        models = await gateway_pb2_grpc.GatewayServiceStub(channel).ListModels(gateway_pb2.ListModelsRequest())
    assert len(models.models) == 1


async def test_a_renewed_certificate_is_served_without_a_restart(mesh: Mesh, gateway) -> None:
    """`kvmesh certs --renew kvstore` on the running mesh: the kvstore presents the new certificate to the
    next connection, from the same process, and the mesh keeps serving."""
    spec = mesh.topology.get("kvstore")
    pid = mesh.process("kvstore").pid
    before = await _served_certificate(spec.port)
    renewed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kvmesh.cli", "certs", "--out", str(mesh.topology.certs), "--renew", "kvstore"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert renewed.returncode == 0, renewed.stderr
    after = await _served_certificate(spec.port)
    assert after != before
    assert after == ssl.PEM_cert_to_DER_cert(mesh.identity("kvstore").cert.read_text())
    assert mesh.process("kvstore").pid == pid
    code, details = await _code(mesh.address("kvstore"), mesh.identity("decode"), KVSTORE, "Lookup")
    assert code == grpc.StatusCode.OK, details
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=list(range(40, 90))),
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=4),
    )
    tokens = [t async for m in gateway.Generate(request) for t in m.token_ids]
    assert len(tokens) == 4


KVSTORE = "kvmesh.api.kvstore.v1.KVStoreService"


async def _served_certificate(port: int) -> bytes:
    pem = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port))
    return ssl.PEM_cert_to_DER_cert(pem)
