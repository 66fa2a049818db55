"""Reading compose files as Compose does: interpolation, .env files, and the typed view kvmesh up plans from."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.launcher.compose import (
    ComposeError,
    Mount,
    PortMapping,
    compose_variables,
    interpolate,
    load_compose,
    parse_duration,
    read_env_file,
)


@pytest.mark.parametrize(
    ("text", "variables", "expected"),
    [
        ("${A}", {"A": "x"}, "x"),
        ("$A/$B", {"A": "x"}, "x/"),  # unset without a default: empty, as Compose does
        ("${A:-d}", {}, "d"),
        ("${A:-d}", {"A": ""}, "d"),  # :- also replaces an empty value...
        ("${A-d}", {"A": ""}, ""),  # ...- only an unset one
        ("${A-d}", {}, "d"),
        ("${A:-../models/x}:/models/${B:-m}:ro", {"B": "llama"}, "../models/x:/models/llama:ro"),
        ("$$HOME and $${A}", {"A": "x"}, "$HOME and ${A}"),
        ("${A:?}", {"A": "set"}, "set"),
    ],
)
def test_interpolation(text, variables, expected) -> None:
    assert interpolate(text, variables) == expected


@pytest.mark.parametrize(("text", "variables"), [("${A:?give A}", {"A": ""}), ("${A?give A}", {})])
def test_a_required_variable_that_is_missing_is_an_error(text, variables) -> None:
    with pytest.raises(ComposeError, match="A is required: give A"):
        interpolate(text, variables)


def test_a_malformed_reference_is_an_error() -> None:
    with pytest.raises(ComposeError, match="invalid interpolation"):
        interpolate("${A B}", {})


def test_env_file_syntax_and_precedence(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text("# comment\n\nA=1\nexport B = two \nC='quoted # not a comment'\nD=plain # a comment\nE=\n")
    (tmp_path / "docker-compose.yml").write_text("services: {}\n")

    assert read_env_file(env) == {"A": "1", "B": "two", "C": "quoted # not a comment", "D": "plain", "E": ""}
    assert read_env_file(tmp_path / "missing") == {}
    # The environment wins over .env, as with Compose.
    variables = compose_variables(tmp_path / "docker-compose.yml", environ={"A": "env"})
    assert variables["A"] == "env" and variables["B"] == "two"


def test_a_bad_env_line_names_its_place(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text("A=1\nthis is not a setting\n")
    with pytest.raises(ComposeError, match=r"\.env:2: expected KEY=VALUE"):
        read_env_file(env)


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("1m30s", 90.0), ("500ms", 0.5), ("2", 2.0), ("1h", 3600.0)]
)
def test_durations(text, seconds) -> None:
    assert parse_duration(text) == seconds


def test_the_typed_view_of_a_service(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("""
x-env: &env
  SHARED: "1"
services:
  decode:
    command: decode --num-blocks 8
    environment:
      <<: *env
      KVMESH_PORT: 50054
      FLAG: true
    ports: ["127.0.0.1:${P:-9000}:50054", "9104", {target: 9999, published: 19999}]
    expose: ["6379/tcp"]
    volumes: ["../models/m:/models/m:ro", "data:/var/lib/x", "/scratch", {type: bind, source: ./b, target: /b}]
    deploy:
      replicas: ${R:-2}
      resources:
        reservations:
          devices:
            - {driver: nvidia, device_ids: ["${GPU:-1}"], capabilities: [gpu]}
    depends_on: [router]
    stop_grace_period: 1m
    profiles: [extra]
  router:
    command: ["router"]
    depends_on: {decode: {condition: service_healthy}}
""")
    compose = load_compose(path, {"GPU": "3"})
    decode, router = compose.services

    assert decode.command == ("decode", "--num-blocks", "8")
    assert decode.environment == {"SHARED": "1", "KVMESH_PORT": "50054", "FLAG": "true"}
    assert decode.ports == (PortMapping(50054, 9000), PortMapping(9104, None), PortMapping(9999, 19999))
    assert decode.expose == (6379,)
    assert decode.volumes == (
        Mount("/models/m", "../models/m", True, True),
        Mount("/var/lib/x", "data", False),
        Mount("/scratch", None, False),
        Mount("/b", "./b", True),
    )
    assert decode.gpus == ("3",) and decode.replicas == 2 and decode.stop_grace_s == 60.0
    assert decode.depends_on == {"router": "service_started"} and decode.profiles == ("extra",)
    assert router.depends_on == {"decode": "service_healthy"} and router.replicas is None
    assert compose.service("router") is router


def test_a_file_without_services_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("version: '3'\n")
    with pytest.raises(ComposeError, match="no services"):
        load_compose(path, {})
