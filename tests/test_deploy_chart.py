"""The Helm chart (deploy/helm/edgecloud), checked offline with the tools operators use: helm's
own lint and render (helm-python-sdk), the Kubernetes schemas (kubernetes-validate), the chart's
values.schema.json over every example, and assertions over the rendered objects (probes, drain,
PDB, GPU requests, the region label, the secret references), with cases that must fail. CRD
kinds (ServiceMonitor, ScaledObject) have no schema there: the assertions check them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.deploy_files import CHART, EXAMPLES, by_kind, deep_merge, example_values, render

K8S_VERSION = "1.32.0"
CRDS = {"ServiceMonitor", "ScaledObject"}
REQUIRED = {"redis": {"url": "redis://redis:6379/0"}, "nodeToken": {"existingSecret": "tok"}}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env_secret(c: dict[str, Any], name: str) -> dict[str, Any]:
    (var,) = [e for e in c["env"] if e["name"] == name]
    return var["valueFrom"]["secretKeyRef"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_lint_passes_on_every_example(example: Path) -> None:
    report = helm.lint(str(CHART), example_values(example), strict=False)
    assert not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] >= 3], report


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_renders_valid_kubernetes_objects(example: Path) -> None:
    import kubernetes_validate

    objects = render(example_values(example))
    assert objects
    for obj in objects:
        if obj["kind"] in CRDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_values_schema_accepts_every_example(example: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(deep_merge(defaults, example_values(example)), schema)


def test_values_schema_refuses_a_wrong_type() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    bad = deep_merge(defaults, {**REQUIRED, "cloud": {"tp": "two"}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://sentinel-0:26379,sentinel-1:26379/edgecloud",
        "rediss+cluster://redis-0:6379,redis-1:6379",
    ],
)
def test_redis_by_sentinel_or_cluster_reaches_gateways_and_nodes(url: str) -> None:
    from gateway.front.config import GatewayConfig

    values = deep_merge(
        example_values(CHART / "examples" / "one-gpu.yaml"), {"redis": {"url": url}}
    )
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(
        deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), values), schema
    )
    objects = render(values)
    (secret,) = [s for s in by_kind(objects, "Secret") if "gateway.yaml" in s["stringData"]]
    cfg = GatewayConfig.model_validate(yaml.safe_load(secret["stringData"]["gateway.yaml"]))
    assert cfg.redis_url == url
    for node in [*by_kind(objects, "StatefulSet"), *by_kind(objects, "DaemonSet")]:
        args = container(node)["args"]
        assert f"--redis={url}" in args
    bad = deep_merge(
        yaml.safe_load((CHART / "values.yaml").read_text()),
        {**REQUIRED, "redis": {"url": "redis+sharded://" + url.split("://", 1)[1]}},
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_gateway_probes_drain_pdb_and_spread() -> None:
    objects = render(example_values(CHART / "examples" / "cpu-only.yaml"))
    (dep,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("gw")
              or d["metadata"]["name"].endswith("gateway")]  # fmt: skip
    spec = dep["spec"]["template"]["spec"]
    c = container(dep)
    paths = {
        p: c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert paths == {"startupProbe": "/startupz", "readinessProbe": "/readyz",
                     "livenessProbe": "/livez"}  # fmt: skip
    drain = int(c["args"][c["args"].index("--drain-timeout") + 1])
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] > drain + sleep
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert {t["topologyKey"] for t in spec["topologySpreadConstraints"]} >= {
        "topology.kubernetes.io/zone"
    }
    (pdb,) = by_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert not by_kind(objects, "HorizontalPodAutoscaler") and not by_kind(objects, "ScaledObject")
    # the secrets by reference: the node token everywhere, Redis's password
    for workload in [dep, *by_kind(objects, "StatefulSet"), *by_kind(objects, "DaemonSet")]:
        assert env_secret(container(workload), "EDGECLOUD_NODE_TOKEN")["name"] == (
            "edgecloud-node-token"
        )
        assert env_secret(container(workload), "EDGECLOUD_REDIS_PASSWORD")["name"] == (
            "redis-password"
        )
    (cfg,) = by_kind(objects, "Secret")
    gateway_yaml = yaml.safe_load(cfg["stringData"]["gateway.yaml"])
    assert gateway_yaml["redis_url"] == "redis://redis-master.redis.svc:6379/0"
    from gateway.front.config import GatewayConfig

    GatewayConfig.model_validate(gateway_yaml)  # the file the gateway reads is a valid config


def test_edge_daemonset_per_region_with_its_selector_and_flag() -> None:
    objects = render(example_values(CHART / "examples" / "cpu-only.yaml"))
    daemons = {
        d["metadata"]["labels"]["edgecloud.io/region"]: d for d in by_kind(objects, "DaemonSet")
    }
    assert set(daemons) == {"eu-west", "us-east"}
    for region, ds in daemons.items():
        spec = ds["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"edgecloud.io/region": region}
        assert f"--region={region}" in container(ds)["args"]
        assert ds["spec"]["template"]["metadata"]["labels"]["edgecloud.io/region"] == region


def test_cloud_gpu_requests_parallelism_and_startup() -> None:
    one = render(example_values(CHART / "examples" / "one-gpu.yaml"))
    (sts,) = by_kind(one, "StatefulSet")
    c = container(sts)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sts["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900  # a model load
    tp2 = render(example_values(CHART / "examples" / "tp2.yaml"))
    (sts,) = by_kind(tp2, "StatefulSet")
    c = container(sts)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert "--tp=2" in c["args"] and "--pp=1" in c["args"]
    (keda,) = by_kind(tp2, "ScaledObject")
    assert keda["spec"]["scaleTargetRef"]["name"].endswith("-gateway")
    assert "edgecloud_in_flight_requests" in keda["spec"]["triggers"][0]["metadata"]["query"]
    cpu = render(example_values(CHART / "examples" / "cpu-only.yaml"))
    (sts,) = by_kind(cpu, "StatefulSet")
    assert "nvidia.com/gpu" not in container(sts)["resources"]["limits"]
    assert "--device=cpu" in container(sts)["args"]


def test_monitoring_scrapes_with_the_admin_key_and_ships_the_dashboard() -> None:
    objects = render(example_values(CHART / "examples" / "one-gpu.yaml"))
    (sm,) = by_kind(objects, "ServiceMonitor")
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"]["name"] == "edgecloud-admin-key"
    (dash,) = [c for c in by_kind(objects, "ConfigMap") if "edgecloud.json" in c["data"]]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dash["data"]["edgecloud.json"])
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for series in ("ttft_seconds", "e2e_seconds", "decisions_total", "node_waiting",
                   "node_kv_blocks_used", "node_prefix_hit_rate", "circuit_open",
                   "prediction_error_ratio"):  # fmt: skip
        assert f"edgecloud_{series}" in exprs, series


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cloud": {"tp": 2, "gpus": 3}}, "cloud.gpus (3) must be cloud.tp x cloud.pp"),
        ({"cloud": {"tp": 2, "gpus": 0}}, "needs cloud.gpus"),
        ({"redis": {"url": ""}}, "redis.url is required"),
        ({"nodeToken": {"existingSecret": ""}}, "nodeToken.existingSecret is required"),
        (
            {"monitoring": {"serviceMonitor": {"enabled": True}}},
            "adminKeySecret is required while gateway.config.observability",
        ),
        (
            {"gateway": {"autoscaling": {"enabled": True}, "keda": {"enabled": True}}},
            "pick one",
        ),
    ],
)
def test_bad_values_fail_the_render(change: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(deep_merge(REQUIRED, change))
