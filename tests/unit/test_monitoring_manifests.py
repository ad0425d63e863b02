"""deploy/: what Prometheus scrapes, what the dashboard and the autoscalers read, and the
adapter rule between them agree with the metrics the servers really export. Offline, on the
manifests as ``kubectl apply -k deploy/k8s`` would create them (``tests.unit.k8s_model``; the
rest of the manifests' checks are in ``test_manifests``).
"""

from __future__ import annotations

import ast
import copy
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

import ps.service.metrics
from protos import ps_pb2 as pb
from protos.rpc.guard import RpcMetrics
from tests.unit.k8s_model import (
    NS,
    ROOT,
    SHARD_LABEL,
    VARIANTS,
    Pod,
    Proc,
    Resource,
    built,
    container_ports,
    find_resource,
    pods,
    processes,
    serving_deployments,
)


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def resources(variant: str) -> list[Resource]:
    return copy.deepcopy(built(variant))


@pytest.fixture
def procs(resources: list[Resource], monkeypatch: pytest.MonkeyPatch) -> list[Proc]:
    return processes(resources, monkeypatch)


def test_metrics_port_matches_annotations_and_scrape_config(procs: list[Proc]) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    servers = {id(p.pod) for p in procs if p.program in ("ps-server", "ps-infer")}
    seen_pods = {id(p.pod): p.pod for p in procs}
    for pod_id, pod in seen_pods.items():
        targets = [t for c in pod.spec["containers"] for t in scrape_targets(pod, c, job["relabel_configs"])]
        if pod_id not in servers:
            assert targets == [], f"{pod.name}: nothing to scrape"
            continue
        (p,) = [q for q in procs if q.pod is pod and not q.init]
        port = p.config.metrics_port
        assert port is not None and container_ports(p.container)["metrics"] == port
        assert pod.annotations["prometheus.io/scrape"] == "true"
        assert int(pod.annotations["prometheus.io/port"]) == port
        assert len(targets) == 1, f"{pod.name}: scraped {len(targets)} times"
        (t,) = targets
        assert t["__address__"].endswith(f":{port}") and t["__metrics_path__"] == pod.annotations["prometheus.io/path"]
        assert t["namespace"] == NS and t["pod"] == pod.name
        assert t["component"] == pod.labels["app.kubernetes.io/component"]
        shard = str(pod.index) if pod.workload["kind"] == "StatefulSet" else pod.labels.get(SHARD_LABEL)
        assert t.get("shard") == shard, f"{pod.name}: shard label"


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def scrape_targets(pod: Pod, c: dict[str, Any], relabel: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Prometheus' pod discovery (one target per declared container port) and relabelling."""
    meta = {
        "__meta_kubernetes_namespace": NS,
        "__meta_kubernetes_pod_name": pod.name,
        "__meta_kubernetes_pod_ip": "10.1.2.3",
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_container_name": c["name"],
        "__meta_kubernetes_pod_container_init": "false",
        "__metrics_path__": "/metrics",
        "__scheme__": "http",
        "job": "embedding-ps",
    }
    for k, v in pod.labels.items():
        meta[f"__meta_kubernetes_pod_label_{_sanitize(k)}"] = v
        meta[f"__meta_kubernetes_pod_labelpresent_{_sanitize(k)}"] = "true"
    for k, v in pod.annotations.items():
        meta[f"__meta_kubernetes_pod_annotation_{_sanitize(k)}"] = v
    out = []
    for port in c.get("ports", []) or [None]:
        labels = dict(meta, __address__="10.1.2.3")
        if port is not None:
            labels |= {
                "__address__": f"10.1.2.3:{port['containerPort']}",
                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
            }
        result = _relabel(labels, relabel)
        if result is not None:
            out.append(result)
    return out


def _relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    for rc in configs:
        action = rc.get("action", "replace")
        value = rc.get("separator", ";").join(labels.get(s, "") for s in rc.get("source_labels", []))
        m = re.fullmatch(str(rc.get("regex", "(.*)")), value)
        if action == "keep" and not m or action == "drop" and m:
            return None
        if action == "replace" and m:
            result = m.expand(re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rc.get("replacement", "$1")))
            if result:
                labels[rc["target_label"]] = result
            else:
                labels.pop(rc["target_label"], None)
        assert action in ("keep", "drop", "replace"), f"relabel action {action} is not checked here"
    return labels


def shard_registry(monkeypatch: pytest.MonkeyPatch) -> CollectorRegistry:
    """A serving shard's collectors (RPC metrics and ``ShardCollector``) on a stand-in shard
    that holds one table and follows a training shard."""
    registry = CollectorRegistry(auto_describe=False)
    RpcMetrics("ps", registry)
    stats = pb.StatsResponse(tables=[pb.TableStats(name="t")], follow=pb.FollowStatus(source="follow"))
    monkeypatch.setattr(ps.service.metrics, "shard_stats", lambda shard: stats)
    registry.register(ps.service.metrics.ShardCollector(SimpleNamespace(storage_errors=0)))
    return registry


def exposed_metrics(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every series name ps-server and ps-infer can expose: their collectors run on a stand-in
    shard, and metrics made from a literal name are read from the source."""
    registry = shard_registry(monkeypatch)
    RpcMetrics("ps_infer", registry)
    families = [(f.name, f.type) for f in registry.collect()]
    makers = {"Histogram": "histogram", "Counter": "counter", "Gauge": "gauge", "Summary": "summary"}
    for path in [*(ROOT / "ps").glob("*.py"), *(ROOT / "protos").glob("*.py"), *(ROOT / "worker").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                kind = makers.get(func.removesuffix("MetricFamily"))
                if kind and isinstance(node.args[0].value, str):
                    families.append((node.args[0].value.removesuffix("_total"), kind))
    suffixes = {
        "histogram": ("_bucket", "_sum", "_count"),
        "counter": ("_total",),
        "gauge": ("",),
        "summary": ("", "_sum", "_count"),
    }
    return {name + s for name, kind in families for s in suffixes.get(kind, ("",))}


def test_dashboard_shows_metrics_the_servers_expose(monkeypatch: pytest.MonkeyPatch) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "ps-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and panels
    exposed = exposed_metrics(monkeypatch)
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    target_labels = {
        rc["target_label"] for rc in scrape["scrape_configs"][0]["relabel_configs"] if "target_label" in rc
    }
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and "datasource" in variables
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            used = set(re.findall(r"\bps_[a-z0-9_]+", expr))
            assert used and used <= exposed, f"{panel['title']}: {sorted(used - exposed)} are not exposed"
            # labels matched in selectors come from the scrape config (metric labels are grouped by)
            matched = set(re.findall(r"(\w+)\s*=~?\s*\"", expr))
            assert matched <= target_labels, f"{panel['title']}: {matched - target_labels} are not scrape labels"
            for var in re.findall(r"\$(\w+)", expr):
                assert var in variables or var.startswith("__"), f"{panel['title']}: no variable ${var}"


# --- autoscaling


def _series_selector(query: str) -> tuple[str, list[tuple[str, str, str]]]:
    """``name{label="value",...}`` as its name and (label, operator, value) matchers."""
    m = re.fullmatch(r"(\w+)\{(.*)\}", query)
    assert m, f"seriesQuery {query!r}: expected name{{label matchers}}"
    return m.group(1), re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', m.group(2))


def _matches(value: str, op: str, want: str) -> bool:
    hit = re.fullmatch(want, value) is not None if "~" in op else value == want
    return hit != op.startswith("!")


def adapter_metrics(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[str, str, str]]]:
    """The per-pod metrics deploy/prometheus/adapter.yaml makes (the name an autoscaler asks
    for -> the matchers of the series it reads), each read from a series a serving shard's
    real collectors export."""
    exported = {s.name for family in shard_registry(monkeypatch).collect() for s in family.samples}
    made = {}
    for rule in yaml.safe_load((ROOT / "deploy" / "prometheus" / "adapter.yaml").read_text())["rules"]:
        series, matchers = _series_selector(rule["seriesQuery"])
        assert series in exported, f"{series}: a serving shard exports no such series ({sorted(exported)})"
        overrides = rule["resources"]["overrides"]
        assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}, "one value per pod"
        assert all(f"<<.{v}>>" in rule["metricsQuery"] for v in ("Series", "LabelMatchers", "GroupBy")), rule
        # The adapter names the metric by name.matches -> name.as (Go's $1 is Python's \1).
        name = re.sub(rule["name"]["matches"], re.sub(r"\$(\d+)", r"\\\1", rule["name"]["as"]), series)
        made[name] = matchers
    return made


def test_autoscalers_scale_on_what_the_pods_report(resources: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    # ps-infer on CPU (metrics-server); each serving shard on its replicas' lookups, a Pods
    # metric that prometheus-adapter makes from the series Prometheus scrapes from them.
    relabel = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    made = adapter_metrics(monkeypatch)
    budgets = {r["metadata"]["name"]: r["spec"] for r in resources if r["kind"] == "PodDisruptionBudget"}
    scaled = []
    for hpa in (r for r in resources if r["kind"] == "HorizontalPodAutoscaler"):
        name, spec = hpa["metadata"]["name"], hpa["spec"]
        ref = spec["scaleTargetRef"]
        target = find_resource(resources, ref["kind"], ref["name"])
        scaled.append(ref["name"])
        assert ref["apiVersion"] == target["apiVersion"] and ref["name"] == name
        assert "replicas" not in target["spec"], f"{name}: every `kubectl apply` would reset what the autoscaler set"
        # Two replicas at least, so that a drain may take one while the budget holds.
        assert spec["minReplicas"] >= 2 and spec["minReplicas"] > budgets[name].get("minAvailable", 0), name
        assert spec["maxReplicas"] > spec["minReplicas"], name
        pod = next(pods([target]))
        for metric in spec["metrics"]:
            if metric["type"] == "Resource":
                assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
                for c in pod.spec["containers"]:  # utilization is of the containers' requests
                    assert "cpu" in c["resources"]["requests"], f"{name}: {c['name']} requests no CPU"
                continue
            assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue", metric
            wanted = metric["pods"]["metric"]["name"]
            assert wanted in made, f"{name}: no adapter rule makes {wanted} (it makes {sorted(made)})"
            # The pod's series, labelled as the scrape config labels it, are those the rule reads.
            (labels,) = [
                t
                for c in pod.spec["containers"]
                for t in scrape_targets(pod, c, relabel["scrape_configs"][0]["relabel_configs"])
            ]
            for label, op, value in made[wanted]:
                assert _matches(labels.get(label, ""), op, value), f"{name}: its pods' {label}={labels.get(label)}"
    serving = [d["metadata"]["name"] for d in serving_deployments(resources)]
    assert sorted(scaled) == sorted(["ps-infer", *serving]), scaled
