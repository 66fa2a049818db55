"""Mutual TLS in the service runtime: who gets in, who is refused and how, and a rotated certificate served live."""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.runtime import create_channel, serve
from kvmesh.runtime.certs import ensure_mesh_certs, renew, role_identity, role_paths, self_signed
from kvmesh.runtime.tls import TlsFiles
from tests.runtime import fakes


@pytest.fixture(scope="module")
def mesh_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_mesh_certs(tmp_path_factory.mktemp("certs"))


async def _lookup(address: str, identity: TlsFiles | None) -> kvstore_pb2.LookupResponse:
    async with create_channel(address, identity) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        return await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=[b"a"]), timeout=5)


async def _code(address: str, identity: TlsFiles | None) -> tuple[grpc.StatusCode, str]:
    try:
        await _lookup(address, identity)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def test_allowed_role_is_served_and_others_refused(mesh_ca: Path, tmp_path: Path) -> None:
    async with serve("kvstore", fakes.build_kvstore, tls=role_identity(mesh_ca, "kvstore")) as rt:
        address = f"127.0.0.1:{rt.port}"
        assert (await _lookup(address, role_identity(mesh_ca, "decode"))).num_present_prefix == 1
        # A valid certificate of the wrong role: in, but refused by name.
        code, details = await _code(address, role_identity(mesh_ca, "gateway"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "'gateway'" in details and "KVStoreService/Lookup" in details and "decode" in details
        # No certificate at all, and plaintext: the handshake fails.
        assert (await _code(address, None))[0] == grpc.StatusCode.UNAVAILABLE
        # A certificate that names the right role but no CA of the mesh signed.
        cert, key = self_signed("decode")
        (tmp_path / "fake.pem").write_bytes(cert)
        (tmp_path / "fake.key").write_bytes(key)
        forged = TlsFiles(mesh_ca / "ca.pem", tmp_path / "fake.pem", tmp_path / "fake.key")
        assert (await _code(address, forged))[0] == grpc.StatusCode.UNAVAILABLE


async def test_a_service_dialling_a_role_refuses_a_server_of_another_role(mesh_ca: Path) -> None:
    """A stolen kvstore key cannot pose as the router to a worker: the client checks the server's role."""
    async with serve("kvstore", fakes.build_kvstore, tls=role_identity(mesh_ca, "kvstore")) as rt:
        address, me = f"127.0.0.1:{rt.port}", role_identity(mesh_ca, "decode")
        async with create_channel(address, me, peer="kvstore") as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            assert (await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=[b"a"]), timeout=5)).num_present_prefix
        async with create_channel(address, me, peer="router") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await kvstore_pb2_grpc.KVStoreServiceStub(channel).Lookup(kvstore_pb2.LookupRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_health_answers_any_mesh_certificate_and_healthz_over_http(mesh_ca: Path) -> None:
    async with serve("kvstore", fakes.build_kvstore, tls=role_identity(mesh_ca, "kvstore")) as rt:
        async with create_channel(f"127.0.0.1:{rt.port}", role_identity(mesh_ca, "operator")) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        url = f"http://127.0.0.1:{rt.metrics_port}/healthz"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        assert body == b"SERVING\n"


async def test_rotated_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    folder = ensure_mesh_certs(tmp_path / "certs")
    served = role_identity(folder, "kvstore")
    async with serve("kvstore", fakes.build_kvstore, tls=served) as rt:
        address = f"127.0.0.1:{rt.port}"
        before = await _peer_certificate(rt.port)
        await _lookup(address, role_identity(folder, "decode"))
        renew(folder, "kvstore")
        after = await _peer_certificate(rt.port)
        assert after != before
        assert after == ssl.PEM_cert_to_DER_cert(served.cert.read_text())
        # Clients made with the old certificates and with new ones both still get in.
        renew(folder, "decode")
        assert (await _lookup(address, role_identity(folder, "decode"))).num_present_prefix == 1


async def _peer_certificate(port: int) -> bytes:
    """The certificate the server presents to a new connection (DER)."""
    pem = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port))
    return ssl.PEM_cert_to_DER_cert(pem)


def test_a_start_keeps_current_certificates_and_renews_one_about_to_expire(tmp_path: Path) -> None:
    folder = ensure_mesh_certs(tmp_path / "certs")
    kept = {role: role_paths(folder, role)[0].read_bytes() for role in ("router", "decode")}
    renew(folder, "decode", days=10)  # inside the renewal window
    expiring = role_paths(folder, "decode")[0].read_bytes()
    ensure_mesh_certs(folder)
    assert role_paths(folder, "router")[0].read_bytes() == kept["router"]
    assert role_paths(folder, "decode")[0].read_bytes() not in (expiring, kept["decode"])


def test_certificates_of_another_ca_are_replaced(tmp_path: Path) -> None:
    folder = ensure_mesh_certs(tmp_path / "certs")
    (folder / "ca.pem").unlink()
    (folder / "ca.key").unlink()
    old = role_paths(folder, "router")[0].read_bytes()
    ensure_mesh_certs(folder)  # a new CA: every role re-issued from it
    assert role_paths(folder, "router")[0].read_bytes() != old
