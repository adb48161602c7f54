"""Kubernetes manifests in deploy/: schema-validated offline (kubernetes-validate bundles the
OpenAPI schemas, strict mode rejects unknown fields) plus the invariants the design relies on.

python -m pytest tests/deploy/test_manifests.py -q
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the test extra: pip install -e '.[test]'"
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# oldest version with everything used here (pod-index labels, Indexed Jobs) .. the newest bundled
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

from shardserve.serving.frontend.http.protocol import SHUTDOWN_GRACE_S  # noqa: E402
from tests.deploy.crd_schemas import is_crd, validate_crd  # noqa: E402 (needs the skip above)


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in _docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_every_manifest_passes_the_schema() -> None:
    docs = _docs()
    assert {d["kind"] for _, d in docs} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "ConfigMap",
        "Job",
    }
    assert {d["kind"] for _, d in docs} >= {"ServingRuntime", "InferenceService", "LeaderWorkerSet"}
    for version in K8S_VERSIONS:
        for filename, doc in docs:
            try:
                _validate(doc, version)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{filename} {doc['kind']}/{doc['metadata']['name']} (k8s {version}): {exc}")


def _validate(doc: dict[str, Any], version: str) -> None:
    """Strict schema validation; the custom resources through ``tests/deploy/crd_schemas.py``."""
    if is_crd(doc):
        validate_crd(doc, version)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    doc = _one("Deployment")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    unknown = yaml.safe_load(yaml.safe_dump(doc))
    unknown["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, K8S_VERSIONS[-1], strict=True)


def test_deployment_probes_drain_and_grace_period() -> None:
    dep = _one("Deployment", "shardserve")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (
        ports == {"http": 8000, "grpc": int(_env(c)["SHARDSERVE_GRPC_PORT"])} == {"http": 8000, "grpc": 8001}
    )
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    env = _env(c)
    prestop_s, drain_s = float(env["PRESTOP_S"]), float(env["SHARDSERVE_DRAIN_TIMEOUT_S"])
    assert "PRESTOP_S" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    grace = pod["terminationGracePeriodSeconds"]
    # after the drain time the server answers what is left 503; SHUTDOWN_GRACE_S bounds writing those
    most_s = prestop_s + drain_s + SHUTDOWN_GRACE_S
    assert grace > most_s, (
        f"grace {grace} s <= preStop {prestop_s} s + drain {drain_s} s + {SHUTDOWN_GRACE_S} s"
    )
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == _dockerfile_uid()
    assert (
        dep["spec"]["selector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_service_selects_the_deployment_pods_on_the_named_port() -> None:
    dep, svc = _one("Deployment", "shardserve"), _one("Service", "shardserve")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names


def _exported_metric_names() -> set[str]:
    source = (REPO / "serving" / "metrics.py").read_text()
    return set(re.findall(r'"(shardserve_[a-z_]+)"', source))


def test_hpa_scales_the_deployment_on_an_exported_queue_metric_served_by_the_adapter() -> None:
    hpa, dep = _one("HorizontalPodAutoscaler", "shardserve"), _one("Deployment", "shardserve")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "shardserve_queue_depth_requests"
    assert name in _exported_metric_names(), f"{name} is not defined in serving/metrics.py"
    adapter = yaml.safe_load(_one("ConfigMap", "prometheus-adapter-shardserve")["data"]["config.yaml"])
    exposed = {rule["name"]["as"] for rule in adapter["rules"]}
    assert name in exposed
    for rule in adapter["rules"]:
        series = rule["seriesQuery"].split("{")[0].strip("'")
        assert series in _exported_metric_names(), series
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics" and annotations["prometheus.io/port"] == "8000"


def test_gang_example_spans_two_hosts_with_torchrun_variables() -> None:
    job, svc = _one("Job", "shardserve-gang"), _one("Service", "shardserve-gang")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = _env(c)
    world = int(env["WORLD_SIZE"])
    assert world == spec["completions"] == spec["parallelism"] == 2
    assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
    rank_ref = next(e for e in c["env"] if e["name"] == "RANK")["valueFrom"]["fieldRef"]["fieldPath"]
    assert "job-completion-index" in rank_ref
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert env["MASTER_ADDR"].startswith(f"{job['metadata']['name']}-0.{svc['metadata']['name']}.")
    assert int(env["MASTER_PORT"]) == svc["spec"]["ports"][0]["port"]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert c["command"][-1] == "/opt/shardserve/gang_probe.py"
    assert "COPY deploy/gang_probe.py /opt/shardserve/gang_probe.py" in (REPO / "Dockerfile").read_text()


def _dockerfile_uid() -> int:
    users = re.findall(r"^USER\s+(\d+)", (REPO / "Dockerfile").read_text(), flags=re.M)
    assert users, "Dockerfile has no numeric USER"
    return int(users[-1].split(":")[0])


# ------------------------------------------------------------------------------------------ KServe


def test_the_kserve_validator_rejects_a_broken_manifest() -> None:
    runtime = _one("ServingRuntime", "shardserve")
    for mutate, match in [
        (
            lambda d: d["spec"]["containers"][0]["ports"][0].update(containerPort="8080"),
            "is not of type 'integer'",
        ),
        (lambda d: d["spec"]["containers"][0].update(readinessProbes={}), "readinessProbes"),
        (lambda d: d["spec"].update(protocolVersion=["v2"]), "protocolVersion"),
        (lambda d: d["spec"].update(protocolVersions=["v3"]), "'v3' is not one of"),
    ]:
        broken = yaml.safe_load(yaml.safe_dump(runtime))
        mutate(broken)
        with pytest.raises(kubernetes_validate.ValidationError, match=match):
            validate_crd(broken, K8S_VERSIONS[-1])
    isvc = yaml.safe_load(yaml.safe_dump(_one("InferenceService", "squad-qa")))
    isvc["spec"]["predictor"]["model"]["modelformat"] = {"name": "x"}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_crd(isvc, K8S_VERSIONS[-1])


def test_kserve_runtime_serves_the_v2_protocol_on_open_probes() -> None:
    runtime, isvc = _one("ServingRuntime", "shardserve"), _one("InferenceService", "squad-qa")
    spec = runtime["spec"]
    (c,) = spec["containers"]
    assert c["name"] == "kserve-container" and "v2" in spec["protocolVersions"]
    args = c["args"]
    assert args[0] == "serve"
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert flags["--served-model-name"] == "{{.Name}}"  # KServe fills in the InferenceService name
    from shardserve.serving.frontend.settings import ServeSettings

    for flag in flags:  # every flag is a real `shardserve serve` flag
        assert flag[2:].replace("-", "_") in ServeSettings.model_fields, flag
    for env in c["env"]:
        if env["name"].startswith("SHARDSERVE_"):
            assert env["name"][len("SHARDSERVE_") :].lower() in ServeSettings.model_fields, env["name"]
    port = int(flags["--port"])
    assert [p["containerPort"] for p in c["ports"]] == [port] == [8080]  # Knative routes one port
    assert int(flags["--grpc-port"]) not in (port, 8012, 8022, 9090, 9091)  # not the queue-proxy's ports
    ServeSettings(port=port, grpc_port=int(flags["--grpc-port"]))  # a valid pair
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": port}
    key = next(e for e in c["env"] if e["name"] == "SHARDSERVE_API_KEY")["valueFrom"]["secretKeyRef"]
    assert key["optional"] is True  # no Secret: the API is open, the pod still starts
    assert c["securityContext"]["runAsUser"] == _dockerfile_uid()
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "v2"
    assert model["modelFormat"]["name"] in {f["name"] for f in spec["supportedModelFormats"]}
    # the served name ({{.Name}} = the InferenceService name) is a valid served_model_name
    assert ServeSettings(served_model_name=isvc["metadata"]["name"]).served_model_name == "squad-qa"


# ------------------------------------------------------------------------------------------ LeaderWorkerSet


def _flags(args: list[str]) -> dict[str, str]:
    return dict(zip(args[1::2], args[2::2], strict=True))


def test_lws_replica_spans_two_hosts_leader_serves_and_worker_joins_its_gang() -> None:
    """deploy/lws-two-hosts.yaml: the leader's serve flags and the worker's join settings agree."""
    from shardserve.serving.frontend.settings import ServeSettings

    lws = _one("LeaderWorkerSet", "shardserve-2host")
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    (leader,) = tmpl["leaderTemplate"]["spec"]["containers"]
    (worker,) = tmpl["workerTemplate"]["spec"]["containers"]
    args = leader["args"]
    assert args[0] == "serve"
    flags = _flags(args)
    for flag in flags:  # every flag is a real `shardserve serve` flag
        assert flag[2:].replace("-", "_") in ServeSettings.model_fields, flag
    pp = int(flags["--pp"])
    external = [int(r) for r in flags["--external-ranks"].split(",")]
    assert tmpl["size"] == pp == 2 and external == list(range(1, pp))  # one pod per stage; leader: rank 0
    assert flags["--replicas"] == "1" and tmpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert flags["--gang-host"] == "$(POD_IP)"  # this pod's address, not every interface
    pod_ip = next(e for e in leader["env"] if e["name"] == "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"]
    assert pod_ip == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports["rendezvous"] == int(flags["--gang-port"]) == int(_env(worker)["MASTER_PORT"])
    assert "shardserve worker" in worker["command"][-1] and "$LWS_LEADER_ADDRESS" in worker["command"][-1]
    assert '--rank "$LWS_WORKER_INDEX"' in worker["command"][-1]
    keys = [
        next(e for e in c["env"] if e["name"] == "SHARDSERVE_GANG_KEY")["valueFrom"]["secretKeyRef"]
        for c in (leader, worker)
    ]
    assert keys[0] == keys[1] and "optional" not in keys[0]  # one shared key, required
    assert leader["readinessProbe"]["httpGet"]["path"] == "/readyz"
    svc = _one("Service", "shardserve-2host")
    leader_labels = tmpl["leaderTemplate"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= leader_labels.items()
    assert not svc["spec"]["selector"].items() <= tmpl["workerTemplate"]["metadata"]["labels"].items()
    # the leader's settings validate as `shardserve serve` would (with a key, as the Secret gives)
    settings = ServeSettings(
        pp=pp, replicas=1, external_ranks=external, gang_host="10.1.2.3", gang_port=int(flags["--gang-port"]),
        gang_key="ab" * 32,
    )  # fmt: skip
    assert settings.pool_slots == pp


def test_the_lws_validator_rejects_a_broken_manifest() -> None:
    lws = _one("LeaderWorkerSet", "shardserve-2host")
    for mutate, match in [
        (lambda d: d["spec"]["leaderWorkerTemplate"].update(size="two"), "is not of type 'integer'"),
        (lambda d: d["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"), "is not one of"),
        (
            lambda d: d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].update(containerz=[]),
            "containerz",
        ),
    ]:
        broken = yaml.safe_load(yaml.safe_dump(lws))
        mutate(broken)
        with pytest.raises(kubernetes_validate.ValidationError, match=match):
            validate_crd(broken, K8S_VERSIONS[-1])
