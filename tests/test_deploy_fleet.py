"""deploy/fleet: replicas behind vllm-router, an InferencePool and a KEDA ScaledObject, checked
offline like ../deploy (tests/test_deploy.py): Kubernetes schemas, KEDA's CRD model, the flags
against the real CLIs, the router's event sources against the replicas' --kv-events-config,
and the autoscaler's metric against what /metrics exposes."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_deploy import KUBERNETES_VERSION, exposed_sample_names, strict_schema

FLEET = Path(__file__).resolve().parent.parent / "deploy" / "fleet"


def documents() -> dict[str, dict]:
    docs = {}
    for path in sorted((FLEET / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def test_core_manifests_validate_against_kubernetes_schemas():
    import kubernetes_validate

    kinds = []
    for doc in documents().values():
        if "k8s.io/" in doc["apiVersion"] and not doc["apiVersion"].startswith("networking.k8s"):
            continue  # the InferencePool: below
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment", "NetworkPolicy", "Service", "Service", "StatefulSet"]


def test_scaled_object_validates_against_kedas_crd_and_scales_on_a_served_metric():
    import jsonschema
    from cloudcoil.models.keda import v1alpha1

    doc = documents()["ScaledObject/pagedserve-fleet"]
    v1alpha1.ScaledObject.model_validate(doc)
    schema = strict_schema(v1alpha1.ScaledObject)
    jsonschema.validate(doc, schema)
    target = doc["spec"]["scaleTargetRef"]
    assert f"{target['kind']}/{target['name']}" in documents()
    query = doc["spec"]["triggers"][0]["metadata"]["query"]
    (metric,) = re.findall(r"vllm:[a-z_]+", query)
    assert metric == "vllm:num_requests_waiting" and metric in exposed_sample_names()
    doc["spec"]["maxReplicaCountt"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


# The v1 InferencePool fields (gateway-api-inference-extension API reference); no CRD model of
# it is packaged, so this schema is written from the reference and closed like the others.
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object"}},
                },
                "targetPorts": {
                    "type": "array", "minItems": 1, "maxItems": 8,
                    "items": {"type": "object", "additionalProperties": False,
                              "required": ["number"],
                              "properties": {"number": {"type": "integer", "minimum": 1}}},
                },
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string"}, "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "port": {"type": "object", "additionalProperties": False,
                                 "properties": {"number": {"type": "integer"}}},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def test_inference_pool_selects_the_replicas_on_their_http_port():
    import jsonschema

    docs = documents()
    pool = docs["InferencePool/pagedserve-fleet"]
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    pod = docs["StatefulSet/pagedserve-fleet"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert pool["spec"]["targetPorts"][0]["number"] in ports


def _replica_events(args: list[str]) -> dict:
    from server.cli import parse_args

    parsed = parse_args(["serve", *args])
    from engine.kv_events import KVEventsConfig

    return KVEventsConfig.parse(parsed.kv_events_config)


def _router_args(text: str) -> list[str]:
    return shlex.split(text.replace("$${ROUTER_POLICY:-kv_aware}", "kv_aware"))[3:]


def _sources(router: list[str], flag: str) -> dict[str, str]:
    return dict(router[i + 1].split("=", 1) for i, a in enumerate(router) if a == flag)


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_router_reads_each_replicas_events_where_the_replica_binds_them(where):
    if where == "compose":
        services = yaml.safe_load((FLEET / "compose.yaml").read_text())["services"]
        replicas = {f"http://{n}:8000": s["command"] for n, s in services.items() if n != "router"}
        router = _router_args(services["router"]["command"][2])
    else:
        docs = documents()
        args = docs["StatefulSet/pagedserve-fleet"]["spec"]["template"]["spec"]["containers"][0]
        replicas = {f"http://pagedserve-fleet-{i}.pagedserve-fleet:8000": args["args"]
                    for i in range(docs["StatefulSet/pagedserve-fleet"]["spec"]["replicas"])}
        container = docs["Deployment/vllm-router"]["spec"]["template"]["spec"]["containers"][0]
        router = _router_args(container["args"][0])
    workers = router[router.index("--worker-urls") + 1 :]
    workers = workers[: next(i for i, a in enumerate(workers) if a.startswith("--"))]
    assert sorted(workers) == sorted(replicas)
    events = _sources(router, "--kv-event-source")
    replay = _sources(router, "--kv-event-replay-source")
    for url, args in replicas.items():
        config = _replica_events(args)
        assert config.enabled and config.endpoint.startswith("tcp://*:")  # bound in the replica
        host = url.split("//")[1].split(":")[0]
        assert events[url] == f"tcp://{host}:{config.endpoint.rsplit(':', 1)[1]}"
        assert replay[url] == f"tcp://{host}:{config.replay_endpoint.rsplit(':', 1)[1]}"
        block = args[args.index("--block-size") + 1]
        assert router[router.index("--kv-event-block-size") + 1] == block
        model = args[args.index("--served-model-name") + 1]  # the router's model identity
        assert router[router.index("--kv-event-model") + 1] == model
    router_bin = shutil.which("vllm-router")
    if router_bin is not None:  # the flags are the installed router's own
        help_text = subprocess.run([router_bin, "--help"], capture_output=True, text=True).stdout
        for flag in {a for a in router if a.startswith("--")}:
            assert flag in help_text, flag


def test_only_the_router_reaches_the_event_ports():
    policy = documents()["NetworkPolicy/pagedserve-fleet-kv-events"]["spec"]
    for rule in policy["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports & {5557, 5558}:
            assert rule["from"] == [{"podSelector": {"matchLabels": {
                "app.kubernetes.io/name": "vllm-router"}}}]
    services = yaml.safe_load((FLEET / "compose.yaml").read_text())["services"]
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published == ["8000:8000"]  # the events stay on the compose network
