"""deploy/helm/kvmesh, validated offline: helm lint --strict, helm template over the values matrix in
ci/ (and the negative cases in ci/invalid/, which values.schema.json or the templates must reject
with their message), kubectl-validate against Kubernetes' OpenAPI schemas, and the Go test in
deploy/helm/validate/ that decodes every manifest strictly into k8s.io/api types and checks the
chart's invariants. helm and kubectl-validate are built into .tools/bin by scripts/install_deploy_tools.sh
(scripts/install.sh runs it): a missing tool fails these tests, it does not skip them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

from kvmesh.models.catalog import CATALOG, model_dir
from kvmesh.runtime.identity import ROLES

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvmesh"
REDIS_CHART = ROOT / "deploy" / "helm" / "redis"
VALIDATE = ROOT / "deploy" / "helm" / "validate"
TOOLS = ROOT / ".tools" / "bin"
CASES = {
    "default": None,
    **{p.name.removesuffix("-values.yaml"): p for p in sorted((CHART / "ci").glob("*-values.yaml"))},
}
INVALID = sorted((CHART / "ci" / "invalid").glob("*.yaml"))


def _gpu_workers(values: Path | None) -> bool:
    """Whether a case's prefill and decode both request GPUs (``gpus`` defaults to 1)."""
    given = yaml.safe_load(values.read_text()) if values else {}
    return all((given.get(role) or {}).get("gpus", 1) > 0 for role in ("prefill", "decode"))


# Cases whose prefill and decode must request GPUs (cpu-values and tensor-parallel-values run them on the CPU).
GPU_CASES = sorted(case for case, values in CASES.items() if _gpu_workers(values))
# The CRD kubectl-validate checks the ServiceMonitor against: prometheus-operator's, the release
# whose Go types (pkg/apis/monitoring, pinned in deploy/helm/validate/go.mod) the Go test decodes into.
MONITORING_TYPES = "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring"
# The KEDA release whose ScaledObject CRD kubectl-validate checks keda.yaml's objects against
# (scripts/install_deploy_tools.sh fetches it; the newest one Go 1.26 accepts).
KEDA = "github.com/kedacore/keda/v2@v2.20.2"
# kubectl-validate v0.0.4 embeds schemas up to this Kubernetes version.
KUBE_VERSION = "1.30"
RELEASE = "ci"


def tool(name: str) -> str:
    path = TOOLS / name
    assert path.is_file(), f"{path} is missing: scripts/install_deploy_tools.sh (run by scripts/install.sh) builds it"
    return str(path)


def run(cmd: list[str], cwd: Path = ROOT, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def helm_template(values: Path | None) -> subprocess.CompletedProcess:
    cmd = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", "kvmesh"]
    return run(cmd + (["-f", str(values)] if values else []), timeout=120)


@cache
def rendered(case: str) -> str:
    result = helm_template(CASES[case])
    assert result.returncode == 0, f"helm template ({case}):\n{result.stderr}"
    return result.stdout


def manifests(case: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(rendered(case)) if d]


def by_kind(case: str, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests(case) if d["kind"] == kind}


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict(case: str) -> None:
    values = CASES[case]
    result = run([tool("helm"), "lint", "--strict", str(CHART), *(["-f", str(values)] if values else [])], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_lint_strict_the_redis_subchart() -> None:
    result = run([tool("helm"), "lint", "--strict", str(REDIS_CHART)], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_values_are_rejected_with_their_message(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name}: the first line must be `# expect: <part of the error>`"
    result = helm_template(path)
    assert result.returncode != 0, f"{path.name} rendered; it must be rejected"
    assert first.removeprefix("# expect: ") in result.stderr, result.stderr


def go_test(tmp_path: Path, renders: dict[str, str], gpu_cases: list[str]) -> subprocess.CompletedProcess:
    """deploy/helm/validate's test over `renders` (case name -> `helm template` output)."""
    rendered_dir = tmp_path / "rendered"
    rendered_dir.mkdir()
    for case, text in renders.items():
        (rendered_dir / f"{case}.yaml").write_text(text)
    # The flags docs/services.md is generated from, straight from the code: nothing committed to go stale.
    flags = tmp_path / "flags.json"
    gen = run(
        [sys.executable, "scripts/flag_tables.py", "--json", str(flags)], env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert gen.returncode == 0, gen.stderr
    return run(
        [
            "go",
            "test",
            "-count=1",
            "./...",
            "-args",
            f"-rendered={rendered_dir}",
            f"-flags={flags}",
            f"-gpu-cases={','.join(gpu_cases)}",
            f"-callers={CHART / 'files' / 'callers.json'}",
        ],
        cwd=VALIDATE,
        timeout=600,
    )


def test_the_go_test_decodes_every_manifest_strictly_and_checks_the_invariants(tmp_path: Path) -> None:
    """deploy/helm/validate: k8s.io/api types, probes, env against the flags, GPUs, PDBs, HPAs, ..."""
    result = go_test(tmp_path, {case: rendered(case) for case in CASES}, GPU_CASES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_go_test_fails_on_an_env_var_no_flag_reads_and_on_a_gpu_worker_without_a_gpu(tmp_path: Path) -> None:
    """What the schema lets through (any KVMESH_* name, gpus: 0), or a render edited by hand, and only Go catches."""
    renders = {}
    for case, override in {
        "typo": "router.env.KVMESH_REDIS_ADDRESS=redis://x:6379/0",
        "no-gpu": "decode.gpus=0",
    }.items():
        result = run([tool("helm"), "template", RELEASE, str(CHART), "--set", override], timeout=120)
        assert result.returncode == 0, result.stderr
        renders[case] = result.stdout
    # Renders the chart refuses to make: decode at two ranks on its one GPU (the degree edited in by hand,
    # as gpus-short-of-ranks.yaml would), and a GPU pair without the /dev/shm NCCL needs.
    docs = rendered("default").split("\n---\n")
    (i,) = [i for i, d in enumerate(docs) if "# Source: kvmesh/templates/decode.yaml" in d and "kind: Deployment" in d]
    tp = "- name: KVMESH_TENSOR_PARALLEL_SIZE\n              value: "
    assert docs[i].count(tp + '"1"') == 1
    renders["tp-short-of-gpus"] = "\n---\n".join([*docs[:i], docs[i].replace(tp + '"1"', tp + '"2"'), *docs[i + 1 :]])
    pair = run([tool("helm"), "template", RELEASE, str(CHART), "--set", "decode.workersPerReplica=2"], timeout=120)
    assert pair.returncode == 0, pair.stderr
    shm = "\n            - name: dshm\n              mountPath: /dev/shm"
    assert pair.stdout.count(shm) == 1
    renders["tp-without-shm"] = pair.stdout.replace(shm, "")
    result = go_test(tmp_path, renders, ["no-gpu", "tp-short-of-gpus", "tp-without-shm"])
    assert result.returncode != 0
    assert "KVMESH_REDIS_ADDRESS is not a flag of router" in result.stdout, result.stdout
    assert "decode requests no GPU" in result.stdout, result.stdout
    assert "nvidia.com/gpu 1 for 2 tensor-parallel ranks: a GPU per rank" in result.stdout, result.stdout
    assert "2 GPU ranks without a memory emptyDir at /dev/shm" in result.stdout, result.stdout


@cache
def service_monitor_crds() -> Path:
    (version,) = re.findall(rf"^\s*{re.escape(MONITORING_TYPES)} (v\S+)$", (VALIDATE / "go.mod").read_text(), re.M)
    operator = f"github.com/prometheus-operator/prometheus-operator@{version}"
    result = run(["go", "mod", "download", "-json", operator], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    crds = Path(json.loads(result.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    assert (crds / "monitoring.coreos.com_servicemonitors.yaml").is_file(), crds
    return crds


@cache
def scaled_object_crd() -> Path:
    result = run(["go", "mod", "download", "-json", KEDA], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    crd = Path(json.loads(result.stdout)["Dir"]) / "config" / "crd" / "bases" / "keda.sh_scaledobjects.yaml"
    assert crd.is_file(), crd
    return crd


def test_kubectl_validate_accepts_every_manifest(tmp_path: Path) -> None:
    crds = tmp_path / "crds"
    crds.mkdir()
    (crds / "servicemonitors.yaml").write_text(
        (service_monitor_crds() / "monitoring.coreos.com_servicemonitors.yaml").read_text()
    )
    (crds / "scaledobjects.yaml").write_text(scaled_object_crd().read_text())
    for case in CASES:
        (tmp_path / f"{case}.yaml").write_text(rendered(case))
    files = sorted(str(p) for p in tmp_path.glob("*.yaml"))
    result = run(
        [tool("kubectl-validate"), *files, "--version", KUBE_VERSION, "--local-crds", str(crds), "-o", "json"],
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    report = json.loads(result.stdout)
    assert set(report) == set(files), report.keys()
    assert all(r["status"] == "Success" for per_file in report.values() for r in per_file), report


# -- what a particular values case must produce ----------------------------------------------------------


def env_of(workload: dict) -> dict[str, dict]:
    return {e["name"]: e for e in workload["spec"]["template"]["spec"]["containers"][0].get("env", [])}


def test_gpu_values_run_two_plus_two_gpu_workers_from_the_model_cache() -> None:
    deployments = by_kind("gpu", "Deployment")
    for role in ("prefill", "decode"):
        d = deployments[f"{RELEASE}-kvmesh-{role}"]
        assert d["spec"]["replicas"] == 2
        limits = d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
        assert env_of(d)["KVMESH_MODEL"]["value"] == "/models/smollm2-135m-instruct"
        assert d["spec"]["template"]["spec"]["initContainers"][0]["name"] == "wait-for-model"
    (job,) = by_kind("gpu", "Job").values()
    init = job["spec"]["template"]["spec"]["containers"][0]
    assert init["args"] == ["models", "install", "smollm2-135m-instruct"]
    # `kvmesh models install` puts the folder where the services read it.
    (env,) = init["env"]
    assert env["name"] == "KVMESH_MODELS_DIR"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env["name"], env["value"])
        folder = model_dir(CATALOG["smollm2-135m-instruct"])
    assert str(folder) == env_of(deployments[f"{RELEASE}-kvmesh-decode"])["KVMESH_MODEL"]["value"]
    assert set(by_kind("gpu", "PersistentVolumeClaim")) == {f"{RELEASE}-kvmesh-model-cache"}
    assert by_kind("gpu", "ServiceMonitor") and by_kind("gpu", "ConfigMap")


def test_cpu_values_need_no_gpu_and_no_model_cache() -> None:
    for role in ("prefill", "decode"):
        d = by_kind("cpu", "Deployment")[f"{RELEASE}-kvmesh-{role}"]
        assert "nvidia.com/gpu" not in d["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        assert env_of(d)["KVMESH_DEVICE"]["value"] == "cpu"
    assert not by_kind("cpu", "Job") and not by_kind("cpu", "PersistentVolumeClaim")


def test_workers_per_replica_splits_each_pods_worker_over_that_many_cpu_ranks() -> None:
    """workersPerReplica N with gpus: 0: one worker a pod, its engine over N rank processes of that pod's CPU."""
    deployments = by_kind("tensor-parallel", "Deployment")
    decode = deployments[f"{RELEASE}-kvmesh-decode"]
    container = decode["spec"]["template"]["spec"]["containers"][0]
    assert env_of(decode)["KVMESH_TENSOR_PARALLEL_SIZE"]["value"] == "2"
    assert env_of(decode)["KVMESH_DEVICE"]["value"] == "cpu"
    assert "nvidia.com/gpu" not in {**container["resources"].get("limits", {}), **container["resources"]["requests"]}
    assert len(decode["spec"]["template"]["spec"]["containers"]) == 1  # the ranks are processes, not containers
    assert decode["spec"]["replicas"] == 2  # two pods, each a group of two ranks
    assert env_of(deployments[f"{RELEASE}-kvmesh-prefill"])["KVMESH_TENSOR_PARALLEL_SIZE"]["value"] == "1"
    for role in ("prefill", "decode"):  # the default: one rank
        default = by_kind("default", "Deployment")[f"{RELEASE}-kvmesh-{role}"]
        assert env_of(default)["KVMESH_TENSOR_PARALLEL_SIZE"]["value"] == "1"
    # The default 4 cores a decode pod hold up to 4 ranks.
    four = run([tool("helm"), "template", RELEASE, str(CHART), "--set", "decode.workersPerReplica=4,decode.gpus=0"])
    assert four.returncode == 0, four.stderr


def gpu_ranks(settings: list[str]) -> tuple[dict, dict[str, dict]]:
    """The decode Deployment's container and pod volumes rendered with ``settings``."""
    args = [a for setting in settings for a in ("--set", setting)]
    result = run([tool("helm"), "template", RELEASE, str(CHART), *args], timeout=120)
    assert result.returncode == 0, result.stderr
    (decode,) = [
        d
        for d in yaml.safe_load_all(result.stdout)
        if d and d["kind"] == "Deployment" and d["metadata"]["name"] == f"{RELEASE}-kvmesh-decode"
    ]
    pod = decode["spec"]["template"]["spec"]
    return pod["containers"][0], {v["name"]: v for v in pod.get("volumes", [])}


@pytest.mark.parametrize("gpus", [1, 2], ids=["gpus-1", "gpus-per-pod"])
def test_a_gpu_pod_gets_a_gpu_per_rank(gpus: int) -> None:
    """gpus 1 (or workersPerReplica itself): the pod requests and limits a GPU per rank and sees them from cuda:0."""
    container, volumes = gpu_ranks(["decode.workersPerReplica=2", f"decode.gpus={gpus}"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVMESH_TENSOR_PARALLEL_SIZE"] == "2"
    assert env["KVMESH_DEVICE"] == "cuda:0"  # rank r on the pod's cuda:r
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    # NCCL's shared memory: a memory emptyDir at /dev/shm rather than the container's 64Mi.
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
    # A core a rank is the CPU ranks' rule only: GPU ranks compute on their GPUs.
    four, _ = gpu_ranks(["decode.workersPerReplica=4", "decode.resources.requests.cpu=2"])
    assert four["resources"]["limits"]["nvidia.com/gpu"] == 4
    # One rank, one GPU, no /dev/shm of its own (the default).
    one, one_volumes = gpu_ranks([])
    assert one["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "dshm" not in one_volumes and all(m["mountPath"] != "/dev/shm" for m in one.get("volumeMounts", []))


def test_gpu_tensor_parallel_values_give_each_decode_pod_three_gpus() -> None:
    deployments = by_kind("gpu-tensor-parallel", "Deployment")
    decode = deployments[f"{RELEASE}-kvmesh-decode"]
    container = decode["spec"]["template"]["spec"]["containers"][0]
    assert env_of(decode)["KVMESH_TENSOR_PARALLEL_SIZE"]["value"] == "3"
    assert env_of(decode)["KVMESH_DEVICE"]["value"] == "cuda:0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 3
    assert decode["spec"]["replicas"] == 2 and len(decode["spec"]["template"]["spec"]["containers"]) == 1
    prefill = deployments[f"{RELEASE}-kvmesh-prefill"]
    assert env_of(prefill)["KVMESH_TENSOR_PARALLEL_SIZE"]["value"] == "1"
    assert prefill["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ["prefill.workersPerReplica=2", "prefill.gpus=3"],
            "prefill.gpus 3 does not fit prefill.workersPerReplica 2: a pod gets a GPU per rank, so gpus is 0 "
            "(the CPU) or 1 (a GPU per rank: 2 nvidia.com/gpu a pod), or 2, the same counted per pod; rank r runs "
            "on the pod's cuda:r and the extra GPUs would sit idle",
        ),
        (
            ["decode.workersPerReplica=4", "decode.gpus=2"],
            "decode.gpus 2 does not fit decode.workersPerReplica 4: a pod gets a GPU per rank",
        ),
        (["decode.gpus=2"], "decode.gpus 2 does not fit decode.workersPerReplica 1"),
        (["decode.workersPerReplica=2", "decode.gpus=9"], "at '/decode/gpus'"),
        (
            ["decode.workersPerReplica=3", "decode.gpus=0", "decode.resources.requests.cpu=2500m"],
            "decode.workersPerReplica 3: decode.resources.requests.cpu 2500m is less than a core a rank (at least 3)",
        ),
        (["decode.env.KVMESH_TENSOR_PARALLEL_SIZE=2"], "the chart sets KVMESH_TENSOR_PARALLEL_SIZE itself"),
    ],
    ids=[
        "more-gpus-than-ranks",
        "fewer-gpus-than-ranks",
        "two-gpus-one-rank",
        "gpus-past-8",
        "short-of-cores",
        "set-through-env",
    ],
)
def test_a_tensor_parallel_group_is_refused_where_it_cannot_run(settings: list[str], message: str) -> None:
    args = [a for setting in settings for a in ("--set", setting)]
    result = run([tool("helm"), "template", RELEASE, str(CHART), *args], timeout=120)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_tracing_sends_every_service_to_the_charts_jaeger_and_is_off_by_default() -> None:
    jaeger = f"{RELEASE}-kvmesh-jaeger"
    service = by_kind("cpu", "Service")[jaeger]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"otlp-grpc": 4317, "ui": 16686}
    assert by_kind("cpu", "Deployment")[jaeger]
    workloads = {**by_kind("cpu", "Deployment"), **by_kind("cpu", "StatefulSet")}
    for role in ("gateway", "router", "kvstore", "speculator", "prefill", "decode"):
        env = env_of(workloads[f"{RELEASE}-kvmesh-{role}"])
        assert env["KVMESH_OTLP_ENDPOINT"]["value"] == f"http://{jaeger}:4317", role
        assert env["KVMESH_TRACE_SAMPLE_RATIO"]["value"] == "1", role
    datasource = by_kind("cpu", "ConfigMap")[f"{RELEASE}-kvmesh-jaeger-datasource"]
    assert f"url: http://{jaeger}:16686" in datasource["data"]["kvmesh-jaeger.yaml"]
    default = {**by_kind("default", "Deployment"), **by_kind("default", "StatefulSet")}
    assert jaeger not in default
    assert not any("KVMESH_OTLP_ENDPOINT" in env_of(w) for w in default.values() if "kvmesh" in w["metadata"]["name"])


def test_external_redis_replaces_the_subchart() -> None:
    router = by_kind("external-redis", "Deployment")[f"{RELEASE}-kvmesh-router"]
    assert env_of(router)["KVMESH_REDIS_URL"]["value"] == "rediss://redis.infra.svc.cluster.local:6380/2"
    assert router["spec"]["replicas"] == 3
    assert not [
        d for d in manifests("external-redis") if d["metadata"]["labels"].get("app.kubernetes.io/name") == "redis"
    ]
    assert by_kind("default", "StatefulSet")[f"{RELEASE}-redis"]
    default_router = by_kind("default", "Deployment")[f"{RELEASE}-kvmesh-router"]
    assert env_of(default_router)["KVMESH_REDIS_URL"]["value"] == f"redis://{RELEASE}-redis:6379/0"


def test_the_gateway_keeps_stored_responses_in_the_routers_redis() -> None:
    for case in ("default", "external-redis"):
        deployments = by_kind(case, "Deployment")
        router, gateway = (deployments[f"{RELEASE}-kvmesh-{role}"] for role in ("router", "gateway"))
        assert env_of(gateway)["KVMESH_REDIS_URL"] == env_of(router)["KVMESH_REDIS_URL"]
    gateway = by_kind("default", "Deployment")[f"{RELEASE}-kvmesh-gateway"]
    mounts = gateway["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert env_of(gateway)["KVMESH_REDIS_PASSWORD_FILE"]["value"].startswith(
        next(m["mountPath"] for m in mounts if m["name"] == "redis-auth")
    )
    [redis_policy] = [p for name, p in by_kind("default", "NetworkPolicy").items() if name.endswith("-redis")]
    admitted = [
        f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for f in redis_policy["spec"]["ingress"][0]["from"]
    ]
    assert admitted == ["router", "gateway"]


def test_autoscaling_scales_prefill_and_decode_on_their_own_signals() -> None:
    hpas = by_kind("autoscaling", "HorizontalPodAutoscaler")
    metric = {name.rsplit("-", 1)[1]: h["spec"]["metrics"][0]["pods"]["metric"]["name"] for name, h in hpas.items()}
    assert metric == {"prefill": "kvmesh_engine_waiting_sequences", "decode": "kvmesh_engine_running_sequences"}
    assert not by_kind("default", "HorizontalPodAutoscaler")


def test_keda_scales_prefill_and_decode_on_vllm_metric_names_instead_of_the_hpa() -> None:
    scaled = by_kind("keda", "ScaledObject")
    assert set(scaled) == {f"{RELEASE}-kvmesh-prefill", f"{RELEASE}-kvmesh-decode"}
    assert not by_kind("keda", "HorizontalPodAutoscaler")  # KEDA makes its own
    prefill, decode = scaled[f"{RELEASE}-kvmesh-prefill"]["spec"], scaled[f"{RELEASE}-kvmesh-decode"]["spec"]
    assert prefill["scaleTargetRef"]["name"] == f"{RELEASE}-kvmesh-prefill"
    (trigger,) = prefill["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["query"] == (
        f'sum(vllm:num_requests_waiting{{namespace="kvmesh",service="{RELEASE}-kvmesh-prefill"}})'
    )
    assert decode["triggers"][0]["metadata"]["query"] == 'avg(vllm:num_requests_running{job="decode"}) / 48'
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (2, 8)
    assert not by_kind("default", "ScaledObject") and not by_kind("autoscaling", "ScaledObject")


def test_decode_drains_longer_than_the_others() -> None:
    d = by_kind("default", "Deployment")[f"{RELEASE}-kvmesh-decode"]
    assert env_of(d)["KVMESH_GRACE_SECONDS"]["value"] == "120"
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 5 + 120 + 15
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


# -- one source of truth for what the chart vendors ------------------------------------------------------


def test_the_dashboard_is_composes_and_its_datasource_uid_follows_the_value() -> None:
    copy = (CHART / "files" / "kvmesh.json").read_text()
    assert copy == (ROOT / "compose" / "grafana" / "dashboards" / "kvmesh.json").read_text(), (
        "deploy/helm/kvmesh/files/kvmesh.json must equal compose/grafana/dashboards/kvmesh.json: copy it over"
    )
    (cm,) = by_kind("gpu", "ConfigMap").values()
    shipped = cm["data"]["kvmesh.json"]
    json.loads(shipped)
    assert "kvmesh-prometheus" not in shipped  # gpu-values sets datasourceUid: prometheus
    assert shipped.count('"uid": "prometheus"') == copy.count('"uid": "kvmesh-prometheus"') > 0


def test_the_vendored_redis_chart_is_the_packaged_source() -> None:
    """charts/redis-<version>.tgz is deploy/helm/redis packaged (`helm dependency update deploy/helm/kvmesh`)."""
    version = yaml.safe_load((REDIS_CHART / "Chart.yaml").read_text())["version"]
    tgz = CHART / "charts" / f"redis-{version}.tgz"
    assert sorted(p.name for p in (CHART / "charts").iterdir()) == [tgz.name]
    with tarfile.open(tgz) as tar:
        packaged = {m.name.removeprefix("redis/"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    source = {str(p.relative_to(REDIS_CHART)): p.read_bytes() for p in REDIS_CHART.rglob("*") if p.is_file()}
    # helm package rewrites Chart.yaml (keys sorted, comments dropped): compared as data.
    assert yaml.safe_load(packaged.pop("Chart.yaml")) == yaml.safe_load(source.pop("Chart.yaml"))
    assert packaged == source, "stale: run helm dependency update deploy/helm/kvmesh"
    lock = yaml.safe_load((CHART / "Chart.lock").read_text())
    assert [(d["name"], d["version"]) for d in lock["dependencies"]] == [("redis", version)]


def test_the_chart_pins_what_the_repository_does() -> None:
    """appVersion is kvmesh's version, and the Redis image is the one compose runs."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    redis = yaml.safe_load((REDIS_CHART / "values.yaml").read_text())["image"]
    compose = (ROOT / "compose" / "docker-compose.yml").read_text()
    assert f"${{KVMESH_REDIS_IMAGE:-{redis['repository']}:{redis['tag']}}}" in compose


def test_mutual_tls_from_cert_manager_when_its_api_is_there_else_from_the_charts_own_ca() -> None:
    """Each role's Secret mounted into its own pods only; cert-manager names the role as a SPIFFE URI."""
    base = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", "kvmesh"]
    with_cm = run([*base, "--api-versions", "cert-manager.io/v1"], timeout=120)
    assert with_cm.returncode == 0, with_cm.stderr
    docs = [d for d in yaml.safe_load_all(with_cm.stdout) if d]
    certs = {
        d["spec"]["commonName"]: d["spec"] for d in docs if d["kind"] == "Certificate" and not d["spec"].get("isCA")
    }
    roles = list(ROLES)  # the chart's kvmesh.tls.roles are the code's roles
    assert sorted(certs) == sorted(roles)
    for role, spec in certs.items():
        assert spec["uris"] == [f"spiffe://kvmesh/{role}"] and spec["dnsNames"] == [
            f"{role}.kvmesh.mesh",
            "kvmesh.mesh",
        ]
        assert spec["secretName"] == f"{RELEASE}-kvmesh-{role}-tls"
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-tls")]

    own = by_kind("default", "Secret")
    for kind in ("Deployment", "StatefulSet"):
        for name, workload in by_kind("default", kind).items():
            role = workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            if role not in roles:
                continue
            volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
            secret = volumes["tls"]["secret"]["secretName"]
            assert secret == f"{RELEASE}-kvmesh-{role}-tls" and secret in own, name
            assert set(own[secret]["data"]) == {"ca.crt", "tls.crt", "tls.key"}

    plain = run([*base, "--set", "tls.enabled=false"], timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert "KVMESH_TLS_CA" not in plain.stdout and "-tls" not in plain.stdout
