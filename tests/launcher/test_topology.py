"""Planning a mesh from the compose file (pure): processes, start levels, ports, environment, devices, overrides."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from kvmesh.launcher import ComposeError, MeshOptions, build_topology
from kvmesh.launcher.compose import REPO_ROOT, load_compose
from kvmesh.launcher.spec import describe, worker_role_env
from kvmesh.launcher.topology import compose_model_path

MODEL = Path("/models/tiny")
CONTAINER_ADDRESS = re.compile(r"\b(redis|router|kvstore|speculator|prefill|decode|gateway):\d")
RUN = Path("/tmp/run")


def _ports(start: int = 40000):
    counter = itertools.count(start)
    return lambda: next(counter)


def _options(**kw) -> MeshOptions:
    """The repository's compose file with its defaults (no .env, no environment)."""
    return MeshOptions(**({"model": MODEL, "compose_vars": {}} | kw))


def _plan(options: MeshOptions | None = None, gpus: int = 0, ports=None):
    return build_topology(options or _options(), RUN, ports or _ports(), gpu_count=gpus)


def _redis_settings(argv) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for a in argv[1:]:
        if a.startswith("--"):
            key = a[2:]
            settings[key] = []
        else:
            settings[key].append(a)
    return settings


def test_the_default_mesh_is_the_compose_files_services_in_its_order() -> None:
    topo = _plan(_options(python="py"))

    compose_names = [
        s.name for s in load_compose(REPO_ROOT / "compose" / "docker-compose.yml", {}).services if not s.profiles
    ]
    assert compose_names == ["certs", "redis", "router", "kvstore", "speculator", "prefill", "decode", "gateway"]
    # The certs service is no process: the launcher makes the certificates before anything starts.
    assert [p.name for p in topo.processes] == [
        "redis",
        "router",
        "kvstore",
        "speculator",
        "prefill-0",
        "decode-0",
        "gateway",
    ]
    # Start levels are the compose file's depends_on: the speculator depends on nothing.
    assert [[p.name for p in level] for level in topo.levels()] == [
        ["redis", "speculator"],
        ["router"],
        ["kvstore"],
        ["prefill-0", "decode-0"],
        ["gateway"],
    ]
    gateway = topo.get("gateway")
    assert gateway.address == "127.0.0.1:50051"  # the compose file's published port
    assert gateway.argv == ("py", "-m", "services.gateway.main") and gateway.workdir == REPO_ROOT
    assert gateway.env["KVMESH_ROUTER_ADDRESS"] == topo.get("router").address
    assert gateway.env["KVMESH_MODEL"] == str(MODEL) and "KVMESH_MODEL_NAME" not in gateway.env
    assert gateway.env["KVMESH_PORT"] == "50051"
    # Mutual TLS by default, each service with its own role's certificate from the run folder's CA.
    certs = topo.certs
    assert certs is not None and certs.name == "certs"
    for p in topo.processes:
        if p.role != "redis":
            assert p.env["KVMESH_TLS_CERT"] == str(certs / f"{p.role}.pem")
            assert p.env["KVMESH_TLS_CA"] == str(certs / "ca.pem")
    assert gateway.health_identity is None  # the public API serves in plaintext
    assert topo.get("router").health_identity.cert == certs / "operator.pem"
    for name in ("router", "gateway"):  # the gateway keeps stored responses in the router's Redis
        assert topo.get(name).env["KVMESH_REDIS_PASSWORD_FILE"] == str(certs / "redis-password")
    assert topo.get("redis").argv[topo.get("redis").argv.index("--aclfile") + 1] == str(certs / "redis-users.acl")
    assert all(p.stop_grace_s == 30.0 for p in topo.processes if p.name != "redis")  # stop_grace_period: 30s


def test_services_are_wired_to_each_other_through_local_addresses() -> None:
    topo = _plan()
    redis, router, kvstore, spec = (topo.get(n) for n in ("redis", "router", "kvstore", "speculator"))

    settings = _redis_settings(redis.argv)
    assert settings["port"] == [str(redis.port)] and settings["bind"] == ["127.0.0.1"] and settings["dir"] == ["."]
    assert settings["save"] == [""] and settings["appendonly"] == ["no"]  # a local mesh persists nothing
    assert redis.workdir == RUN / "redis" and redis.health == "redis"
    assert router.env["KVMESH_REDIS_URL"] == f"redis://127.0.0.1:{redis.port}/0"  # was redis://redis:6379/0
    assert topo.get("gateway").env["KVMESH_REDIS_URL"] == router.env["KVMESH_REDIS_URL"]
    assert kvstore.env["KVMESH_ROUTER_ADDRESS"] == router.address
    for name in ("prefill-0", "decode-0"):
        env = topo.get(name).env
        assert env["KVMESH_WORKER_ID"] == name and env["KVMESH_DEVICE"] == "cpu"
        assert env["KVMESH_ROUTER_ADDRESS"] == router.address
        assert env["KVMESH_MODEL"] == str(MODEL)
    assert topo.get("decode-0").env["KVMESH_SPECULATOR_ADDRESS"] == spec.address
    assert "KVMESH_SPECULATOR_ADDRESS" not in topo.get("prefill-0").env
    for p in topo.processes[1:]:
        assert p.env["KVMESH_PORT"] == str(p.port) and p.env["KVMESH_METRICS_PORT"] == str(p.metrics_port)
        assert p.env["KVMESH_HOST"] == "127.0.0.1" and p.env["KVMESH_GRACE_SECONDS"] == "20"
        assert not [v for v in p.env.values() if CONTAINER_ADDRESS.search(v)]  # no container address is left


def test_redis_keeps_the_compose_files_persistence_when_asked() -> None:
    settings = _redis_settings(_plan(_options(redis_persistence=True)).get("redis").argv)
    assert settings["appendonly"] == ["yes"] and settings["save"] == ["300 10"] and settings["dir"] == ["."]


def test_named_volumes_live_in_the_run_dir_and_bind_mounts_are_host_folders() -> None:
    topo = _plan(_options(model=None))

    assert topo.get("kvstore").env["KVMESH_DISK_DIR"] == str(RUN / "volumes" / "kvstore-data")
    # No model override: the compose file's read-only bind mount, resolved beside the compose file.
    installed = str(Path.home() / ".cache" / "kvmesh" / "models" / "smollm2-135m-instruct")
    assert (
        topo.get("decode-0").env["KVMESH_MODEL"] == installed and topo.get("gateway").env["KVMESH_MODEL"] == installed
    )
    assert compose_model_path(_options(model=None, compose_vars={"KVMESH_MODEL_DIR": "/srv/llama"})) == Path(
        "/srv/llama"
    )


def test_env_file_and_environment_values_flow_into_the_plan() -> None:
    variables = {
        "KVMESH_DECODE_NUM_BLOCKS": "96",
        "KVMESH_DECODE_REPLICAS": "2",
        "KVMESH_GATEWAY_PORT": "7070",
        "KVMESH_CONTEXT_LENGTH": "512",
    }
    topo = _plan(_options(compose_vars=variables))

    assert [p.name for p in topo.processes if p.role == "decode"] == ["decode-0", "decode-1"]
    assert (
        topo.get("decode-1").env["KVMESH_NUM_BLOCKS"] == "96"
        and topo.get("decode-1").env["KVMESH_WORKER_ID"] == "decode-1"
    )
    assert topo.get("gateway").port == 7070
    assert topo.get("gateway").env["KVMESH_MAX_MODEL_LEN"] == "512"
    assert "KVMESH_MAX_MODEL_LEN" not in _plan().get("gateway").env  # empty = unset: the model's own limit


def test_no_speculator_drops_it_and_every_setting_that_points_at_it() -> None:
    topo = _plan(_options(speculator=False))

    assert "speculator" not in [p.name for p in topo.processes]
    assert "KVMESH_SPECULATOR_ADDRESS" not in topo.get("decode-0").env
    assert topo.get("decode-0").level == topo.get("prefill-0").level


def test_an_insecure_mesh_drops_every_tls_setting_and_redis_password() -> None:
    topo = _plan(_options(tls=False))

    assert topo.certs is None
    for p in topo.processes:
        assert not {"KVMESH_TLS_CA", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_REDIS_PASSWORD_FILE"} & set(p.env)
        assert p.health_identity is None and p.redis_password_file is None
    assert "--aclfile" not in topo.get("redis").argv


def test_no_prefill_workers() -> None:
    topo = _plan(_options(prefill=0))
    assert [p.name for p in topo.processes if p.role in ("prefill", "decode")] == ["decode-0"]


def test_without_a_gpu_the_compose_files_gpu_pins_become_cpu() -> None:
    topo = _plan(_options(device_prefill=None, device_decode=None), gpus=0)
    assert [(p.name, p.device) for p in topo.processes if p.device] == [("prefill-0", "cpu"), ("decode-0", "cpu")]


def test_with_gpus_each_worker_gets_the_gpu_the_compose_file_reserves() -> None:
    options = _options(
        device_prefill=None, device_decode=None, compose_vars={"KVMESH_PREFILL_GPU": "2", "KVMESH_DECODE_GPU": "3"}
    )
    topo = _plan(options, gpus=4)

    assert [(p.name, p.device, p.env["KVMESH_DEVICE"]) for p in topo.processes if p.device] == [
        ("prefill-0", "cuda:2", "cuda:2"),
        ("decode-0", "cuda:3", "cuda:3"),
    ]


def test_a_gpu_pin_this_machine_does_not_have_is_refused() -> None:
    with pytest.raises(ComposeError, match="pinned to GPU 1, but this machine has 1"):
        _plan(_options(device_prefill=None, device_decode=None), gpus=1)


def test_a_tensor_parallel_worker_takes_a_gpu_a_rank_from_its_pin() -> None:
    """KVMESH_PREFILL_GPU=2,3 with two ranks: the worker's device is cuda:2, and its rank 1 runs on cuda:3 (the
    engine's rule). Fewer GPUs pinned than ranks, or GPUs apart, are refused before anything starts."""
    pins = {"KVMESH_PREFILL_GPU": "2,3", "KVMESH_DECODE_GPU": "1", "KVMESH_PREFILL_TP": "2"}
    topo = _plan(_options(device_prefill=None, device_decode=None, compose_vars=pins), gpus=4)
    assert [(p.name, p.device, p.env["KVMESH_TENSOR_PARALLEL_SIZE"]) for p in topo.processes if p.device] == [
        ("prefill-0", "cuda:2", "2"),
        ("decode-0", "cuda:1", "1"),
    ]
    too_few = _options(
        device_prefill=None, device_decode=None, role_env={"decode": {"KVMESH_TENSOR_PARALLEL_SIZE": "2"}}
    )
    with pytest.raises(ComposeError, match="runs 2 tensor-parallel ranks, a GPU each, but is pinned to GPU 1.*GPU=1,2"):
        _plan(too_few, gpus=4)
    apart = _options(device_prefill=None, device_decode=None, compose_vars={**pins, "KVMESH_PREFILL_GPU": "0,2"})
    with pytest.raises(ComposeError, match="pinned to GPUs 0,2: here a worker's ranks run on consecutive GPUs"):
        _plan(apart, gpus=4)


def test_device_overrides_share_out_round_robin() -> None:
    options = _options(prefill=2, decode=3, device_prefill="cuda:0", device_decode="cuda:1, cuda:2")
    topo = _plan(options, gpus=3)

    assert [(p.name, p.device) for p in topo.processes if p.device] == [
        ("prefill-0", "cuda:0"),
        ("prefill-1", "cuda:0"),
        ("decode-0", "cuda:1"),
        ("decode-1", "cuda:2"),
        ("decode-2", "cuda:1"),
    ]


def test_base_port_numbers_everything_but_the_gateway_consecutively() -> None:
    topo = build_topology(_options(base_port=60000, gateway_port=7000), RUN, gpu_count=0)

    ports = [port for p in topo.processes for port in (p.port, p.metrics_port) if port is not None]
    assert topo.get("redis").port == 60000 and topo.get("router").port == 60001
    assert topo.get("gateway").port == 7000
    assert sorted(set(ports) - {7000}) == list(range(60000, 60000 + len(ports) - 1))


def test_free_ports_are_never_handed_out_twice_nor_the_fixed_ones() -> None:
    repeating = itertools.cycle(
        [41000, 41000, 50051, 41001, 41002, 41003, 41004, 41005, 41006, 41007, 41008, 41009, 41010, 41011, 41012, 41013]
    )
    topo = _plan(ports=lambda: next(repeating))

    ports = [port for p in topo.processes for port in (p.port, p.metrics_port) if port is not None]
    assert len(ports) == len(set(ports)) and topo.get("gateway").port == 50051


def test_a_port_a_role_setting_picked_is_never_handed_out_again() -> None:
    # The caller picked 41000 for the gateway's HTTP API; the OS happens to offer it again to the planner.
    options = _options(publish=False, role_env={"gateway": {"KVMESH_HTTP_PORT": "41000"}})
    topo = _plan(options, ports=_ports(41000))

    assert topo.get("gateway").env["KVMESH_HTTP_PORT"] == "41000"
    others = [port for p in topo.processes for port in (p.port, p.metrics_port) if port is not None]
    assert 41000 not in others


def test_every_port_setting_of_a_service_is_mapped_and_published_ones_keep_their_host_port() -> None:
    gateway = _plan().get("gateway")
    assert gateway.env["KVMESH_HTTP_PORT"] == "8000" and gateway.port == 50051  # both published by the compose file
    assert "http 127.0.0.1:8000" in describe(_plan(), RUN)[-1]

    moved = _plan(_options(compose_vars={"KVMESH_GATEWAY_HTTP_PORT": "8100"})).get("gateway")
    assert moved.env["KVMESH_HTTP_PORT"] == "8100"


def test_without_publishing_every_port_is_free_so_meshes_run_side_by_side() -> None:
    topo = _plan(_options(publish=False))
    ports = {port for p in topo.processes for port in (p.port, p.metrics_port) if port}
    ports.add(int(topo.get("gateway").env["KVMESH_HTTP_PORT"]))
    assert not ports & {50051, 8000} and min(ports) >= 40000


def test_clashing_ports_are_refused() -> None:
    with pytest.raises(ValueError, match="port 60001 is given to both"):
        build_topology(_options(base_port=60000, gateway_port=60001), RUN, gpu_count=0)


def test_extra_settings_per_role_and_a_model_name() -> None:
    options = _options(
        model_name="demo", role_env={"decode": {"KVMESH_NUM_BLOCKS": "64"}}, log_level="debug", grace_seconds=3.0
    )
    topo = _plan(options)

    assert topo.get("decode-0").env["KVMESH_NUM_BLOCKS"] == "64"
    assert topo.get("prefill-0").env["KVMESH_NUM_BLOCKS"] == "1024"  # the compose file's
    assert topo.get("gateway").env["KVMESH_MODEL_NAME"] == "demo"
    assert {p.env["KVMESH_LOG_LEVEL"] for p in topo.processes[1:]} == {"debug"}
    assert {p.env["KVMESH_GRACE_SECONDS"] for p in topo.processes[1:]} == {"3"}


@pytest.mark.parametrize("counts", [{"decode": 0}, {"prefill": -1}])
def test_impossible_counts_are_refused(counts) -> None:
    with pytest.raises(ValueError, match="at least one decode worker"):
        MeshOptions(model=MODEL, **counts)


def test_describe_lists_every_endpoint() -> None:
    topo = _plan()
    lines = describe(topo, RUN)

    assert lines[0] == f"  mutual TLS between services; CA and role certificates in {RUN / 'volumes' / 'certs'}"
    lines = lines[1:]
    assert len(lines) == len(topo.processes)
    assert (
        "gateway" in lines[-1]
        and "gRPC 127.0.0.1:50051" in lines[-1]
        and str(RUN / "logs" / "gateway.log") in lines[-1]
    )
    assert "redis://127.0.0.1:" in lines[0]


# -- other compose files -------------------------------------------------------------------------------------


def _compose(tmp_path: Path, text: str) -> MeshOptions:
    path = tmp_path / "compose.yml"
    path.write_text(text)
    return MeshOptions(model=MODEL, compose_file=path, compose_vars={})


_ROUTER = """
  redis:
    image: redis:7
  router:
    command: ["router", "--redis-url", "redis://redis:6379/1"]
    environment: {KVMESH_PORT: "1", KVMESH_METRICS_PORT: "2"}
    depends_on: [redis]
"""


def test_describe_says_how_each_decode_worker_runs_its_steps(monkeypatch) -> None:
    monkeypatch.delenv("KVMESH_COMPILE", raising=False)
    monkeypatch.delenv("KVMESH_DETERMINISTIC", raising=False)
    topo = _plan(_options(compose_vars={"KVMESH_DECODE_REPLICAS": "2"}))
    assert sum("compiled decode steps" in line for line in describe(topo, RUN)) == 2  # the default

    topo = _plan(_options(role_env={"decode": {"KVMESH_COMPILE": "off"}}))
    lines = describe(topo, RUN)
    assert any(line.lstrip().startswith("decode-0") and "eager decode steps" in line for line in lines)
    assert not any("compiled" in line for line in lines)

    # kvmesh up --deterministic: both kinds of worker batch-invariant, decode eager whatever --compile says.
    topo = _plan(_options(role_env=worker_role_env(deterministic=True)))
    assert {p.env.get("KVMESH_DETERMINISTIC") for p in topo.processes if p.role in ("prefill", "decode")} == {"1"}
    assert any("deterministic eager decode steps" in line for line in describe(topo, RUN))


def test_kvmesh_up_gives_prefill_and_decode_workers_their_own_tensor_parallel_degrees() -> None:
    topo = _plan(_options(role_env=worker_role_env(prefill_tp=2, decode_tp=3)))
    degrees = {p.role: p.env.get("KVMESH_TENSOR_PARALLEL_SIZE") for p in topo.processes}
    assert (degrees["prefill"], degrees["decode"], degrees["router"]) == ("2", "3", None)
    assert worker_role_env() == {}  # the defaults add nothing to the compose file's settings
    # Asked for explicitly, a degree of 1 replaces the compose file's (KVMESH_PREFILL_TP=2 in its .env).
    assert worker_role_env(prefill_tp=1) == {"prefill": {"KVMESH_TENSOR_PARALLEL_SIZE": "1"}}
    lines = describe(topo, RUN)
    assert any(line.lstrip().startswith("prefill-0") and "2 tensor-parallel ranks" in line for line in lines)


def test_a_command_s_arguments_are_mapped_too(tmp_path) -> None:
    options = _compose(
        tmp_path,
        "services:"
        + _ROUTER
        + """
  decode:
    command: ["decode"]
    environment: ["KVMESH_PORT=3", "KVMESH_METRICS_PORT=4", "KVMESH_ROUTER_ADDRESS=router:1"]
    depends_on: {router: {condition: service_healthy}}
  grafana:
    image: grafana/grafana
    profiles: [monitoring]
""",
    )
    topo = build_topology(options, RUN, _ports(), gpu_count=0)

    assert [p.name for p in topo.processes] == ["redis", "router", "decode-0"]  # profiled services are extras
    redis = topo.get("redis")
    assert topo.get("router").argv[3:] == ("--redis-url", f"redis://127.0.0.1:{redis.port}/1")
    assert topo.get("decode-0").env["KVMESH_ROUTER_ADDRESS"] == topo.get("router").address
    assert [p.level for p in topo.processes] == [0, 1, 2]


@pytest.mark.parametrize(
    ("services", "error"),
    [
        (
            """
  web:
    image: nginx
""",
            "web: kvmesh up runs redis and kvmesh services",
        ),
        (
            """
  decode:
    command: ["decode"]
    environment: {KVMESH_METRICS_PORT: "4"}
""",
            "set KVMESH_PORT",
        ),
        (
            """
  decode:
    command: ["decode"]
    environment: {KVMESH_PORT: "3", KVMESH_METRICS_PORT: "4"}
    depends_on: [gateway]
  gateway:
    command: ["gateway"]
    environment: {KVMESH_PORT: "5", KVMESH_METRICS_PORT: "6"}
    depends_on: [decode]
""",
            "depends_on cycle",
        ),
        (
            """
  decode:
    command: ["decode"]
    environment: {KVMESH_PORT: "3", KVMESH_METRICS_PORT: "4"}
    ports: ["8000:3"]
    deploy: {replicas: 2}
""",
            "several replicas cannot share host port 8000",
        ),
        (
            """
  router:
    command: ["router"]
    environment: {KVMESH_PORT: "1", KVMESH_METRICS_PORT: "2"}
    deploy: {replicas: 2}
""",
            "only prefill and decode run several replicas",
        ),
        (
            """
  router:
    command: ["router"]
    environment: {KVMESH_PORT: "1", KVMESH_METRICS_PORT: "2"}
""",
            "no decode service",
        ),
    ],
)
def test_compose_files_kvmesh_up_cannot_run_are_refused_clearly(tmp_path, services, error) -> None:
    with pytest.raises(ComposeError, match=error):
        build_topology(_compose(tmp_path, "services:" + services), RUN, _ports(), gpu_count=0)


def test_a_hub_id_reaches_every_process_that_loads_the_model_with_the_snapshot_s_commit() -> None:
    commit = "f" * 40
    topo = _plan(
        _options(model=Path("/hf/hub/models--acme--tiny/snapshots") / commit, hub_id="acme/tiny", commit=commit)
    )
    loads = {p.role for p in topo.processes if "KVMESH_MODEL" in p.env}
    assert loads == {"gateway", "prefill", "decode"}
    for p in topo.processes:
        if p.role in loads:
            assert (p.env["KVMESH_MODEL"], p.env["KVMESH_REVISION"]) == ("acme/tiny", commit), p.name
        else:
            assert "KVMESH_REVISION" not in p.env, p.name
    # a folder: no revision
    assert all("KVMESH_REVISION" not in p.env for p in _plan().processes)


def test_kvmesh_up_resolves_a_hub_id_in_the_hf_cache_or_names_where_it_looked(tmp_path, monkeypatch, capsys) -> None:
    from kvmesh.launcher.cli import _resolve_model
    from tests.models.hf_cache import add_snapshot

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"kvmesh_label": "tiny-label"}')
    commit = "e" * 40
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = add_snapshot(tmp_path / "hub", "acme/tiny", src, commit, refs=("main", "v1"))
    source, label = _resolve_model("acme/tiny", "v1", _options())
    assert (source.path, source.hub_id, source.commit, source.name, label) == (
        snapshot,
        "acme/tiny",
        commit,
        "acme/tiny",
        "tiny-label",
    )
    assert _resolve_model("acme/other", None, _options()) == (None, None)
    err = capsys.readouterr().err
    assert f"the Hugging Face cache {tmp_path / 'hub'} (from $HF_HUB_CACHE): no models--acme--other" in err
    assert _resolve_model(None, "v1", _options()) == (None, None)
    assert "--revision v1 needs a hub id --model" in capsys.readouterr().err
