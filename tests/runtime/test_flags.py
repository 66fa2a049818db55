"""Flags: command line > KVMESH_* env twin > default; a missing required value exits 2 with a clear message."""

from __future__ import annotations

import pytest

from kvmesh.runtime import Flag, common_flags, parse_flags

FLAGS = [
    *common_flags(default_port=50055, default_metrics_port=9105),
    Flag("--router-address", "router gRPC address", required=True),
    Flag("--ram-budget-bytes", "RAM tier budget", default=1 << 30, type=int),
    Flag("--disk-tier", "keep a disk tier", default=False, type=bool),
    Flag("--store-dir", "disk tier directory", env="KVSTORE_DIR"),
]


def test_defaults_and_common_flags() -> None:
    args = parse_flags("kvstore", FLAGS, ["--router-address", "r:1"], environ={})
    assert (args.host, args.port, args.metrics_port, args.log_level) == ("127.0.0.1", 50055, 9105, "info")
    assert args.grace_seconds == 30.0
    assert (args.router_address, args.ram_budget_bytes, args.disk_tier, args.store_dir) == ("r:1", 1 << 30, False, None)


def test_env_twin_overrides_default_and_cli_overrides_env() -> None:
    env = {
        "KVMESH_ROUTER_ADDRESS": "router:50052",
        "KVMESH_RAM_BUDGET_BYTES": "2048",
        "KVMESH_DISK_TIER": "yes",
        "KVMESH_PORT": "6000",
        "KVSTORE_DIR": "/data",  # an explicitly named env var
    }
    args = parse_flags("kvstore", FLAGS, [], environ=env)
    assert (args.router_address, args.ram_budget_bytes, args.disk_tier, args.port, args.store_dir) == (
        "router:50052",
        2048,
        True,
        6000,
        "/data",
    )
    args = parse_flags("kvstore", FLAGS, ["--ram-budget-bytes", "99", "--no-disk-tier", "--port", "0"], environ=env)
    assert (args.ram_budget_bytes, args.disk_tier, args.port) == (99, False, 0)


def test_missing_required_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_flags("kvstore", FLAGS, [], environ={"KVMESH_ROUTER_ADDRESS": ""})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "missing required --router-address (or set KVMESH_ROUTER_ADDRESS)" in err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVMESH_RAM_BUDGET_BYTES": "lots"}, "KVMESH_RAM_BUDGET_BYTES='lots' is not a valid --ram-budget-bytes"),
        ({"KVMESH_DISK_TIER": "maybe"}, "KVMESH_DISK_TIER='maybe' is not a valid --disk-tier"),
        ({"KVMESH_LOG_LEVEL": "loud"}, "KVMESH_LOG_LEVEL='loud': choose from debug, info, warning, error"),
    ],
)
def test_bad_env_value_exits_2(env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_flags("kvstore", FLAGS, [], environ={"KVMESH_ROUTER_ADDRESS": "r:1", **env})
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_names_the_env_twin(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_flags("kvstore", FLAGS, ["--help"], environ={})
    out = capsys.readouterr().out
    assert "KVMESH_RAM_BUDGET_BYTES" in out and "KVSTORE_DIR" in out


def test_part_of_the_mutual_tls_settings_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.runtime import run

    with pytest.raises(SystemExit) as info:
        run("kvstore", lambda ctx: None, default_port=0, default_metrics_port=0, argv=["--tls-ca", "/ca.pem"])
    assert info.value.code == 2
    assert "missing --tls-cert, --tls-key" in capsys.readouterr().err
