"""What a service advertises to its peers: never an address nobody can dial."""

from __future__ import annotations

import socket

import pytest

from kvmesh.runtime.advertise import advertised_address


def test_the_flag_wins_then_the_bound_host() -> None:
    assert advertised_address("0.0.0.0", 50051, "proxy.example:7000") == "proxy.example:7000"
    assert advertised_address("10.1.2.3", 50051, None) == "10.1.2.3:50051"
    assert advertised_address("fd00::5", 50051, "") == "[fd00::5]:50051"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_advertises_what_this_machines_name_resolves_to(monkeypatch, wildcard) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "decode-7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"decode-7": "10.4.0.9"}[name])
    assert advertised_address(wildcard, 50051, None) == "10.4.0.9:50051"


def test_a_wildcard_bind_on_a_nameless_machine_asks_for_the_flag(monkeypatch) -> None:
    def unresolvable(name: str) -> str:
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    with pytest.raises(ValueError, match="set --advertise-address"):
        advertised_address("0.0.0.0", 50051, None)
