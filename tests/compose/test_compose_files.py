"""compose/ as a compose implementation reads it (Debian's docker-compose validates without an engine), and kept in
step with the code: flags, metrics, the generated CPU file and docs/services.md."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from kvmesh.launcher import MeshOptions, build_topology
from kvmesh.launcher.compose import COMPOSE_FILE, REPO_ROOT, load_compose, load_raw
from kvmesh.launcher.compose_cpu import CPU_COMPOSE_FILE, render
from kvmesh.launcher.topology import role_of
from kvmesh.runtime.flags import common_flags

COMPOSE = REPO_ROOT / "compose"
KVMESH_SERVICES = ("router", "kvstore", "speculator", "prefill", "decode", "gateway")
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_docker_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose is not installed (Debian: apt-get install docker-compose; scripts/install.sh installs it)",
)


def docker_compose_config(tmp_path: Path, *files: Path, env_file: Path | None = None) -> dict:
    """``docker-compose -f ... config``: the file set as Compose resolves it (no engine needed)."""
    if env_file is None:
        env_file = tmp_path / "empty.env"
        env_file.write_text("")
    argv = [DOCKER_COMPOSE, *(a for f in files for a in ("-f", str(f))), "--env-file", str(env_file), "config"]
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_", "COMPOSE_"))}
    result = subprocess.run(argv, cwd=REPO_ROOT, env=clean_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _device_ids(service: dict) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [
        i
        for d in devices
        if "gpu" in d.get("capabilities", []) and d.get("driver") == "nvidia"
        for i in d["device_ids"]
    ]


@needs_docker_compose
def test_the_gpu_file_pins_prefill_and_decode_to_their_own_gpu(tmp_path) -> None:
    services = docker_compose_config(tmp_path, COMPOSE_FILE)["services"]

    assert _device_ids(services["prefill"]) == ["0"] and _device_ids(services["decode"]) == ["1"]
    for name in ("prefill", "decode"):
        assert services[name]["environment"]["KVMESH_DEVICE"] == "cuda:0"  # the one GPU the container sees
    assert not any(_device_ids(services[n]) for n in services if n not in ("prefill", "decode"))


@needs_docker_compose
def test_gpu_ids_replicas_and_ports_come_from_the_env_file(tmp_path) -> None:
    env = tmp_path / "gpus.env"
    env.write_text(
        "KVMESH_PREFILL_GPU=2\nKVMESH_DECODE_GPU=5\nKVMESH_DECODE_REPLICAS=3\nKVMESH_GATEWAY_PORT=7000\n"
        "KVMESH_MODEL_DIR=/srv/models/llama\nKVMESH_SERVED_MODEL=llama\n"
    )
    services = docker_compose_config(tmp_path, COMPOSE_FILE, env_file=env)["services"]

    assert _device_ids(services["prefill"]) == ["2"] and _device_ids(services["decode"]) == ["5"]
    assert services["decode"]["deploy"]["replicas"] == 3
    assert {"published": 7000, "target": 50051} in services["gateway"]["ports"]
    for name in ("prefill", "decode", "gateway"):
        assert "/srv/models/llama:/models/llama:ro" in services[name]["volumes"]
        assert services[name]["environment"]["KVMESH_MODEL"] == "/models/llama"


@needs_docker_compose
@pytest.mark.parametrize("compose_file", [COMPOSE_FILE, CPU_COMPOSE_FILE], ids=["gpu", "cpu"])
def test_tensor_parallel_degrees_come_from_their_own_compose_variables(tmp_path, compose_file) -> None:
    """KVMESH_PREFILL_TP / KVMESH_DECODE_TP set each worker's KVMESH_TENSOR_PARALLEL_SIZE; on GPUs the GPU
    variables list one GPU a rank, which the worker's container sees as cuda:0, cuda:1, ..."""
    services = docker_compose_config(tmp_path, compose_file)["services"]
    for name in ("prefill", "decode"):
        assert services[name]["environment"]["KVMESH_TENSOR_PARALLEL_SIZE"] == "1"
    env = tmp_path / "tp.env"
    env.write_text("KVMESH_PREFILL_TP=2\nKVMESH_DECODE_TP=3\n")
    services = docker_compose_config(tmp_path, compose_file, env_file=env)["services"]

    assert services["prefill"]["environment"]["KVMESH_TENSOR_PARALLEL_SIZE"] == "2"
    assert services["decode"]["environment"]["KVMESH_TENSOR_PARALLEL_SIZE"] == "3"
    assert not any(
        "KVMESH_TENSOR_PARALLEL_SIZE" in s.get("environment", {})
        for n, s in services.items()
        if n not in ("prefill", "decode")
    )
    want = {"prefill": ["0"], "decode": ["1"]} if compose_file == COMPOSE_FILE else {"prefill": [], "decode": []}
    assert {n: _device_ids(services[n]) for n in ("prefill", "decode")} == want
    if compose_file == COMPOSE_FILE:  # a GPU a rank: the reservation names them all (docker joins them so too)
        env.write_text("KVMESH_PREFILL_TP=2\nKVMESH_DECODE_TP=3\nKVMESH_PREFILL_GPU=0,1\nKVMESH_DECODE_GPU=2,3,4\n")
        services = docker_compose_config(tmp_path, compose_file, env_file=env)["services"]
        assert {n: _device_ids(services[n]) for n in ("prefill", "decode")} == {"prefill": ["0,1"], "decode": ["2,3,4"]}


def test_kvmesh_up_takes_the_tensor_parallel_degrees_from_the_compose_variables(tmp_path) -> None:
    variables = {"KVMESH_PREFILL_TP": "2", "KVMESH_DECODE_TP": "3"}
    topology = build_topology(MeshOptions(model=tmp_path, compose_vars=variables), tmp_path, gpu_count=0)
    degrees = {p.role: p.env.get("KVMESH_TENSOR_PARALLEL_SIZE") for p in topology.processes}
    assert (degrees["prefill"], degrees["decode"], degrees["router"]) == ("2", "3", None)


@needs_docker_compose
def test_env_example_documents_the_defaults(tmp_path) -> None:
    assert docker_compose_config(tmp_path, COMPOSE_FILE, env_file=COMPOSE / ".env.example") == docker_compose_config(
        tmp_path, COMPOSE_FILE
    )


@needs_docker_compose
@pytest.mark.parametrize("compose_file", [COMPOSE_FILE, CPU_COMPOSE_FILE], ids=["gpu", "cpu"])
def test_health_checks_and_start_order(tmp_path, compose_file) -> None:
    config = docker_compose_config(tmp_path, compose_file)
    services = config["services"]

    assert set(services) == {"certs", "redis", *KVMESH_SERVICES, "prometheus", "grafana", "jaeger"}
    for name in KVMESH_SERVICES:
        assert services[name]["healthcheck"]["test"] == ["CMD", "kvmesh", "health"]  # grpc.health.v1 on KVMESH_PORT
        assert services[name]["command"] == [name]
        assert services[name]["stop_grace_period"] == "30s"
        assert float(services[name]["environment"]["KVMESH_GRACE_SECONDS"]) < 30
    redis_check = services["redis"]["healthcheck"]["test"]
    assert redis_check[0] == "CMD-SHELL" and "redis-cli" in redis_check[1] and "ping" in redis_check[1]
    # Every dependency waits for health, not just for a started container.
    assert {(n, d) for n, s in services.items() for d in s.get("depends_on", {})} >= {
        ("router", "redis"),
        ("kvstore", "router"),
        ("prefill", "router"),
        ("decode", "router"),
        ("decode", "speculator"),
        ("gateway", "router"),
        ("gateway", "prefill"),
        ("gateway", "decode"),
    }
    # The one-shot certs service is waited for until it exited 0; everything else until healthy.
    for name, s in services.items():
        for dep, d in s.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep == "certs" else "service_healthy"
            assert d["condition"] == want, (name, dep)
    assert services["certs"]["command"] == ["certs", "--out", "/certs"]
    for name in ("redis", *KVMESH_SERVICES):
        assert "certs:/certs:ro" in services[name]["volumes"], name
    for name in KVMESH_SERVICES:
        env = services[name]["environment"]
        assert (env["KVMESH_TLS_CERT"], env["KVMESH_TLS_KEY"]) == (f"/certs/{name}.pem", f"/certs/{name}.key")


@needs_docker_compose
def test_persistence_volumes_and_the_monitoring_profile(tmp_path) -> None:
    config = docker_compose_config(tmp_path, COMPOSE_FILE)
    services = config["services"]

    kvstore = services["kvstore"]
    assert f"kvstore-data:{kvstore['environment']['KVMESH_DISK_DIR']}:rw" in kvstore["volumes"]
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes" and "--save" in redis
    assert "redis-data:/data:rw" in services["redis"]["volumes"]
    assert "compile-cache:/var/cache/kvmesh/compile:rw" in services["decode"]["volumes"]
    assert set(config["volumes"]) == {"certs", "compile-cache", "redis-data", "kvstore-data", "prometheus-data"}
    assert services["prometheus"]["profiles"] == ["monitoring"] and services["grafana"]["profiles"] == ["monitoring"]
    assert not any(services[n].get("profiles") for n in ("redis", *KVMESH_SERVICES))


@needs_docker_compose
def test_the_tracing_profile_wires_every_service_to_jaeger(tmp_path) -> None:
    untraced = docker_compose_config(tmp_path, COMPOSE_FILE)["services"]
    assert not any(untraced[n]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] for n in KVMESH_SERVICES)  # off
    env_file = tmp_path / "traced.env"
    env_file.write_text("KVMESH_TRACING_ENDPOINT=http://jaeger:4317\nKVMESH_TRACING_SAMPLE_RATIO=1\n")
    services = docker_compose_config(tmp_path, COMPOSE_FILE, env_file=env_file)["services"]

    assert services["jaeger"]["profiles"] == ["tracing"]
    for name in KVMESH_SERVICES:
        env = services[name]["environment"]
        assert (env["OTEL_EXPORTER_OTLP_ENDPOINT"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("http://jaeger:4317", "1")
    datasources = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/jaeger.yml").read_text())
    assert datasources["datasources"][0]["url"] == "http://jaeger:16686"


@needs_docker_compose
def test_the_cpu_file_is_the_same_topology_without_gpus(tmp_path) -> None:
    gpu = docker_compose_config(tmp_path, COMPOSE_FILE)["services"]
    cpu = docker_compose_config(tmp_path, CPU_COMPOSE_FILE)["services"]

    assert set(cpu) == set(gpu)
    for name, service in cpu.items():
        assert not _device_ids(service) and "resources" not in service.get("deploy", {})
        env = service.get("environment", {})
        if "KVMESH_DEVICE" in env:
            assert env["KVMESH_DEVICE"] == "cpu"
        assert {k: v for k, v in env.items() if k != "KVMESH_DEVICE"} == {
            k: v for k, v in gpu[name].get("environment", {}).items() if k != "KVMESH_DEVICE"
        }
        assert service.get("depends_on") == gpu[name].get("depends_on")
    assert cpu["decode"]["image"] == "kvmesh:cpu"
    assert cpu["decode"]["build"]["args"]["BASE"].startswith("python:3.11-slim")


# -- in step with the code (no docker-compose needed) ------------------------------------------------------


@pytest.mark.parametrize("compose_file", [COMPOSE_FILE, CPU_COMPOSE_FILE], ids=["gpu", "cpu"])
def test_the_monitoring_services_have_health_checks(compose_file) -> None:
    services = yaml.safe_load(compose_file.read_text())["services"]
    for name, ready in (
        ("prometheus", "http://127.0.0.1:9090/-/ready"),
        ("grafana", "http://127.0.0.1:3000/api/health"),
    ):
        assert services[name]["healthcheck"]["test"][-1] == ready


def test_the_cpu_file_is_generated_from_the_gpu_file() -> None:
    assert CPU_COMPOSE_FILE.read_text() == render(), "stale: run python -m kvmesh.launcher.compose_cpu"


def test_docs_services_md_is_current() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/flag_tables.py", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


@cache
def _flag_env_vars(role: str) -> frozenset[str]:
    module = importlib.import_module(f"services.{role}.main")
    return frozenset(f.env_var for f in (*common_flags(0, 0), *module.FLAGS))


def _compose_variables(path: Path) -> set[str]:
    return set(re.findall(r"\$\{([_a-zA-Z][_a-zA-Z0-9]*)", path.read_text()))


@pytest.mark.parametrize("compose_file", [COMPOSE_FILE, CPU_COMPOSE_FILE], ids=["gpu", "cpu"])
def test_every_kvmesh_setting_in_the_compose_file_is_a_flag_of_that_service(compose_file) -> None:
    for service in load_compose(compose_file, {}).services:
        role = role_of(service)
        if role in KVMESH_SERVICES:
            unknown = {k for k in service.environment if k.startswith("KVMESH_")} - _flag_env_vars(role)
            assert not unknown, f"{service.name} sets {sorted(unknown)}, which `kvmesh {role}` does not read"


def test_compose_variables_are_never_a_service_flag_and_all_are_documented() -> None:
    flags = set().union(*(_flag_env_vars(r) for r in KVMESH_SERVICES))
    variables = _compose_variables(COMPOSE_FILE) | _compose_variables(CPU_COMPOSE_FILE)

    # A shell variable meant for the compose file must not also configure a service behind its back.
    assert not variables & flags
    documented = {
        line.split("=", 1)[0]
        for line in (COMPOSE / ".env.example").read_text().splitlines()
        if line and not line.startswith(("#", "COMPOSE_"))
    }
    assert variables == documented


def test_prometheus_scrapes_every_kvmesh_service_at_its_metrics_port() -> None:
    config = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    for service in load_compose(COMPOSE_FILE, {}).services:
        if role_of(service) in KVMESH_SERVICES:
            sd = jobs[service.name]["dns_sd_configs"][0]
            assert sd["names"] == [service.name] and sd["type"] == "A"
            assert sd["port"] == int(service.environment["KVMESH_METRICS_PORT"])


@cache
def _exported_metric_names() -> frozenset[str]:
    """Metric names the code defines: the first argument of every metric constructor under kvmesh/ and services/."""
    names: set[str] = set()
    pattern = re.compile(r"""(?:Counter|Gauge|Histogram|Summary)(?:MetricFamily)?\(\s*f?["']([a-z_{}.]+)["']""")
    for root in ("kvmesh", "services"):
        for path in (REPO_ROOT / root).rglob("*.py"):
            names |= set(pattern.findall(path.read_text()))
    return frozenset(names)


def _defined(metric: str) -> bool:
    """Whether the code exports ``metric`` (a Prometheus series name: counters get _total, histograms _bucket...)."""
    base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
    for name in _exported_metric_names():
        if "{" in name:  # f"kvmesh_engine_{f.name}": a family built from a dataclass or a list
            if re.fullmatch(re.sub(r"\\\{[^}]*\\\}", "[a-z_]+", re.escape(name)), base):
                return True
        elif name == base:
            return True
    return False


def test_the_grafana_dashboard_shows_what_the_services_export() -> None:
    dashboard = json.loads((COMPOSE / "grafana" / "dashboards" / "kvmesh.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}
    metrics = set(re.findall(r"kvmesh_[a-z_]+", " ".join(exprs.values())))

    assert not [m for m in metrics if not _defined(m)], "the dashboard graphs metrics nobody exports"
    for title, metric in [
        ("Time to first token", "kvmesh_gateway_time_to_first_token_seconds_bucket"),
        ("Inter-token latency", "kvmesh_gateway_inter_token_latency_seconds_bucket"),
        ("Tokens/s", "kvmesh_gateway_generated_tokens_total"),
        ("Cache hit rate", "kvmesh_engine_cached_prompt_tokens_total"),
        ("KV usage", "kvmesh_engine_kv_blocks_in_use"),
        ("Speculator acceptance", "kvmesh_engine_draft_tokens_accepted_total"),
    ]:
        assert metric in exprs[title]
    uid = dashboard["panels"][1]["datasource"]["uid"]
    datasources = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasources["datasources"][0]["uid"] == uid


def test_kvmesh_up_plans_exactly_the_compose_files_mesh(tmp_path) -> None:
    compose = load_compose(COMPOSE_FILE, {})
    topology = build_topology(MeshOptions(model=tmp_path, compose_vars={}), tmp_path, gpu_count=0)

    # Every service but the certs one is a process; the certs are made by the launcher itself.
    assert {p.role for p in topology.processes} == {role_of(s) for s in compose.services if not s.profiles} - {"certs"}
    assert topology.certs == tmp_path / "volumes" / "certs"
    for p in topology.processes:
        if p.role in KVMESH_SERVICES:
            service = compose.service(p.name.rsplit("-", 1)[0] if p.role in ("prefill", "decode") else p.name)
            assert set(p.env) >= set(k for k, v in service.environment.items() if v)


def test_the_image_runs_any_service_as_a_non_root_user_with_a_grpc_health_check() -> None:
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE=(\S+)", dockerfile, re.M)

    assert base is not None and base.group(1).startswith("nvidia/cuda:")
    assert re.search(r"^FROM \$\{BASE\}", dockerfile, re.M)
    assert re.search(r"^USER kvmesh$", dockerfile, re.M)
    assert "HEALTHCHECK" in dockerfile and 'CMD ["kvmesh", "health"]' in dockerfile
    assert re.search(r'^ENTRYPOINT \["kvmesh-entrypoint"\]', dockerfile, re.M)
    entrypoint = COMPOSE / "entrypoint.sh"
    assert subprocess.run(["sh", "-n", str(entrypoint)]).returncode == 0
    assert entrypoint.read_text().rstrip().endswith('exec kvmesh "$@"')
    raw = load_raw(COMPOSE_FILE)
    assert raw["x-cpu-variant"]["build-args"]["BASE"].startswith("${KVMESH_CPU_BASE_IMAGE:-python:3.11-slim")
