"""A model of what the manifests in deploy/ make a cluster run, for tests/unit/test_manifests.py.

``build`` does what ``kubectl kustomize`` does for the kustomizations there (resources, other
kustomizations among them, generators, images, replicas, components, patches, name suffixes,
labels, replacements; an unknown key fails rather than being skipped); ``pods`` expands a
workload's pods as the cluster would (ordinal, pod-index label, downward API, ``$(VAR)``
references) and ``processes`` runs each container's command line and environment through the
real parser of its program. ``token_role`` says which role a mounted token file has on the
shards; ``serving_deployments`` and ``replicas_address`` find the serving shards (a Deployment of
replicas each, deploy/k8s/serve) and the ``dns:`` name that lists a shard's replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from torch.distributed.run import get_args_parser as torchrun_parser

from client import ClientConfig
from deploy.admin import build_parser as admin_parser
from deploy.rendezvous import parse_args as rendezvous_args
from protos.rpc.auth import Tokens, read_client_token
from protos.rpc.settings import load_settings
from ps.service import load_config
from ps.service.config import build_parser
from worker.config import ENV_PREFIX as TRAINER_PREFIX
from worker.config import TrainerConfig
from worker.serving import ENV_PREFIX as INFER_PREFIX
from worker.serving import InferConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NS = "ml-prod"  # any namespace: addresses must follow the pods' own
JOB_UID = "5f0c2a7e-9d1b-4c3e-8a6f-2b7d1e0c9a84"  # the uid Kubernetes gives a Job
# An older release still common in managed clusters (the pod-index label the shards read is set
# from 1.28 on) and the newest whose schema kubernetes-validate ships.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())
VARIANTS = ("plain", "tls")  # built as shipped, and with the TLS component on

Resource = dict[str, Any]


# --- building what kustomize would apply


def load_resources(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def resource_key(r: Resource) -> tuple[str, str]:
    return r["kind"], r["metadata"]["name"]


def find_resource(resources: list[Resource], kind: str, name: str) -> Resource:
    found = [r for r in resources if resource_key(r) == (kind, name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} resources"
    return found[0]


# Strategic merge: lists of these fields merge item by item on the key (as the API's patch
# strategy says); other lists are replaced, and a null deletes the field.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> None:
    for k, v in patch.items():
        if v is None:
            base.pop(k, None)
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        elif isinstance(v, list) and k in _MERGE_KEYS and isinstance(base.get(k), list):
            key = _MERGE_KEYS[k]
            new = []
            for item in v:
                match = [b for b in base[k] if b.get(key) == item.get(key)]
                if match:
                    _merge(match[0], item)
                else:
                    new.append(copy.deepcopy(item))
            base[k][:0] = new  # kustomize puts new items first
        else:
            base[k] = copy.deepcopy(v)


def _field_path(path: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]|[^.\[\]]+", path)


def _walk(node: Any, path: list[str]) -> tuple[Any, str]:
    """The container of the last element of ``path`` and that element's key."""
    for part in path[:-1]:
        node = _step(node, part)
    return node, path[-1]


def _step(node: Any, part: str) -> Any:
    if part.startswith("["):
        k, _, v = part[1:-1].partition("=")
        found = [item for item in node if item.get(k) == v]
        assert len(found) == 1, f"field path element {part}: {len(found)} matches"
        return found[0]
    assert part in node, f"field path element {part!r} not found"
    return node[part]


def _select(resources: list[Resource], selector: dict[str, str]) -> list[Resource]:
    """The resources a kustomize selector (a patch's target, a replacement's select) picks:
    by kind, name and ``labelSelector`` (``key=value`` pairs); it must pick one at least."""
    assert set(selector) <= {"kind", "name", "labelSelector"}, f"selector fields not built here: {selector}"
    pairs = [kv.partition("=") for kv in selector.get("labelSelector", "").split(",") if kv]
    assert all(sep and "!" not in k for k, sep, _ in pairs), f"only key=value label selectors: {selector}"
    found = [
        r
        for r in resources
        if selector.get("kind", r["kind"]) == r["kind"]
        and selector.get("name", r["metadata"]["name"]) == r["metadata"]["name"]
        and all(r["metadata"].get("labels", {}).get(k.strip()) == v.strip() for k, _, v in pairs)
    ]
    assert found, f"{selector} selects nothing"
    return found


def _replace(resources: list[Resource], replacement: dict[str, Any]) -> None:
    src = replacement["source"]
    assert set(src) <= {"kind", "name", "fieldPath"}, src
    value = _step(*_walk(find_resource(resources, src["kind"], src["name"]), _field_path(src["fieldPath"])))
    for target in replacement["targets"]:
        assert set(target) <= {"select", "fieldPaths"}, target
        for r in _select(resources, target["select"]):
            for path in target["fieldPaths"]:
                node, last = _walk(r, _field_path(path))
                old = node[last]  # kustomize keeps the target's type: "2" stays a string, 2 a number
                node[last] = str(value) if isinstance(old, str) else int(value) if isinstance(old, int) else value


def _apply_patches(resources: list[Resource], base: Path, patches: list[dict[str, Any]]) -> None:
    for p in patches:
        assert "path" in p and set(p) <= {"path", "target"}, f"{base}: only strategic merge patch files: {p}"
        for patch in load_resources(base / p["path"]):
            if "target" not in p:
                _merge(find_resource(resources, patch["kind"], patch["metadata"]["name"]), patch)
                continue
            body = copy.deepcopy(patch)
            del body["metadata"]["name"]  # with a target, the patch goes to each resource it selects
            for r in _select(resources, p["target"]):
                assert r["kind"] == patch["kind"], f"{p}: a {patch['kind']} patch selects a {r['kind']}"
                _merge(r, copy.deepcopy(body))


# What a name suffix may rename here: kinds nothing refers to by name but an autoscaler. (Renaming
# a Service a StatefulSet names, a claim, a ConfigMap or a Secret would need kustomize's other
# name references, which are not built.)
_RENAMED = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def _add_suffix(resources: list[Resource], suffix: str) -> None:
    """``nameSuffix``: every name gets it, and so do the autoscalers' references (nameReference)."""
    renamed = {}
    for r in resources:
        assert r["kind"] in _RENAMED, f"nameSuffix on a {r['kind']}: what refers to it is not renamed here"
        renamed[r["kind"], r["metadata"]["name"]] = r["metadata"]["name"] = r["metadata"]["name"] + suffix
    for r in resources:
        if r["kind"] == "HorizontalPodAutoscaler":
            ref = r["spec"]["scaleTargetRef"]
            ref["name"] = renamed.get((ref["kind"], ref["name"]), ref["name"])


def _label_selectors(r: Resource) -> Iterator[dict[str, str]]:
    """The selectors ``labels`` with ``includeSelectors`` extends in ``r`` (kustomize's
    commonLabels field specs for the kinds used here) and its pod template's labels."""
    kind, spec = r["kind"], r.get("spec", {})
    assert kind not in ("ReplicationController", "CronJob", "NetworkPolicy"), f"labels on a {kind}: not built here"
    if kind == "Service":
        yield spec.setdefault("selector", {})
    elif kind in ("Deployment", "StatefulSet", "ReplicaSet", "DaemonSet"):
        yield spec.setdefault("selector", {}).setdefault("matchLabels", {})
        pod = spec["template"]["spec"]
        assert "affinity" not in pod, "affinity selectors are not built here"
        if kind in ("Deployment", "StatefulSet"):
            for c in pod.get("topologySpreadConstraints", []):
                if "matchLabels" in c.get("labelSelector", {}):
                    yield c["labelSelector"]["matchLabels"]
        for claim in spec.get("volumeClaimTemplates", []):
            yield claim["metadata"].setdefault("labels", {})
    elif kind in ("Job", "PodDisruptionBudget") and "matchLabels" in spec.get("selector", {}):
        yield spec["selector"]["matchLabels"]
    t = pod_template(r)
    if t is not None:
        yield t["metadata"].setdefault("labels", {})


def _add_labels(resources: list[Resource], label: dict[str, Any]) -> None:
    assert set(label) <= {"pairs", "includeSelectors", "includeTemplates"}, label
    for r in resources:
        r["metadata"].setdefault("labels", {}).update(label["pairs"])
        if label.get("includeSelectors"):
            for node in _label_selectors(r):
                node.update(label["pairs"])
        elif label.get("includeTemplates") and (t := pod_template(r)) is not None:
            t["metadata"].setdefault("labels", {}).update(label["pairs"])


KUSTOMIZATION_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "images",
    "replicas",
    "configMapGenerator",
    "replacements",
    "components",
    "patches",
    "nameSuffix",
    "labels",
}


def build(directory: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> list[Resource]:
    """The resources ``kubectl apply -k directory`` would create; ``edit`` may change the
    kustomization first (as a person would, e.g. enabling the TLS component)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if edit is not None:
        edit(k)
    assert set(k) <= KUSTOMIZATION_KEYS, f"kustomization keys this test does not build: {set(k) - KUSTOMIZATION_KEYS}"
    resources: list[Resource] = []
    for name in k.get("resources", []):
        path = directory / name
        resources += build(path) if path.is_dir() else load_resources(path)
    for gen in k.get("configMapGenerator", []):
        assert gen["options"]["disableNameSuffixHash"], "generated names are referenced as written"
        data = dict(lit.split("=", 1) for lit in gen["literals"])
        meta = {"name": gen["name"], "annotations": gen["options"].get("annotations", {})}
        resources.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for component in k.get("components", []):
        c = yaml.safe_load((directory / component / "kustomization.yaml").read_text())
        assert c["kind"] == "Component" and set(c) <= {"apiVersion", "kind", "patches"}, c
        _apply_patches(resources, directory / component, c["patches"])
    _apply_patches(resources, directory, k.get("patches", []))
    if "nameSuffix" in k:
        _add_suffix(resources, k["nameSuffix"])
    for label in k.get("labels", []):
        _add_labels(resources, label)
    for image in k.get("images", []):
        for r in resources:
            for c in containers_of(r):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image['newName']}:{image['newTag']}"
    for rep in k.get("replicas", []):
        found = [r for r in resources if r["metadata"]["name"] == rep["name"] and "replicas" in r.get("spec", {})]
        assert len(found) == 1, rep
        found[0]["spec"]["replicas"] = rep["count"]
    for replacement in k.get("replacements", []):
        _replace(resources, replacement)
    local = "config.kubernetes.io/local-config"
    return [r for r in resources if r["metadata"].get("annotations", {}).get(local) != "true"]


def _enable_tls(k: dict[str, Any]) -> None:
    k["components"] = ["tls"]


@functools.cache
def built(variant: str, directory: Path = K8S) -> list[Resource]:
    """What ``directory`` (deploy/k8s, or deploy/k8s/scale) builds, its ``tls`` component on
    for the variant "tls"."""
    return build(directory, _enable_tls if variant == "tls" else None)


def kustomization_files(directory: Path, components: Sequence[str] = ()) -> set[Path]:
    """The files ``build(directory)`` reads, with the optional ``components`` enabled."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = {directory / "kustomization.yaml"}
    for r in k.get("resources", []):
        path = (directory / r).resolve()  # ../base: the same files as from any other directory
        files |= kustomization_files(path) if path.is_dir() else {path}
    files |= {directory / p["path"] for p in k.get("patches", [])}
    for component in [*k.get("components", []), *components]:
        files |= kustomization_files(directory / component)
    return files


def pod_template(r: Resource) -> dict[str, Any] | None:
    return r["spec"]["template"] if r["kind"] in ("StatefulSet", "Deployment", "Job") else None


def containers_of(r: Resource) -> list[dict[str, Any]]:
    t = pod_template(r)
    return [] if t is None else t["spec"].get("initContainers", []) + t["spec"]["containers"]


# --- pods and processes as the cluster would run them


@dataclass
class Pod:
    workload: Resource
    name: str
    index: int | None  # StatefulSet ordinal or Job completion index; None for a Deployment pod
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]


@dataclass
class Proc:
    pod: Pod
    container: dict[str, Any]
    init: bool
    argv: list[str]
    env: dict[str, str]
    program: str = ""  # ps-server, ps-infer, trainer, or a shell
    config: Any = None
    torchrun: argparse.Namespace | None = None
    client_env: dict[str, str] = field(default_factory=dict)


def pods(resources: list[Resource]) -> Iterator[Pod]:
    for r in resources:
        t = pod_template(r)
        if t is None:
            continue
        name, meta = r["metadata"]["name"], t["metadata"]
        if r["kind"] == "StatefulSet":
            for i in range(r["spec"]["replicas"]):
                extra = {"apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": f"{name}-{i}"}
                yield Pod(r, f"{name}-{i}", i, meta["labels"] | extra, meta.get("annotations", {}), t["spec"])
        elif r["kind"] == "Job":
            for i in range(r["spec"].get("completions", 1)):
                labels = meta["labels"] | {
                    "batch.kubernetes.io/job-completion-index": str(i),
                    "batch.kubernetes.io/job-name": name,
                    "batch.kubernetes.io/controller-uid": JOB_UID,  # the Job's, the same in each of its pods
                }
                annotations = meta.get("annotations", {}) | {"batch.kubernetes.io/job-completion-index": str(i)}
                yield Pod(r, f"{name}-{i}-x7k2p", i, labels, annotations, t["spec"])
        else:
            yield Pod(r, f"{name}-5d8f7c9b6-x7k2p", None, meta["labels"], meta.get("annotations", {}), t["spec"])


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables only, ``$$`` escapes."""
    out = _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)
    assert "$(" not in out, f"{text!r}: refers to a variable the container does not define"
    return out


def _downward(pod: Pod, path: str) -> str:
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        source = pod.labels if m.group(1) == "labels" else pod.annotations
        assert m.group(2) in source, f"{pod.name}: the pod has no {m.group(1)[:-1]} {m.group(2)!r}"
        return source[m.group(2)]
    known = {"metadata.namespace": NS, "metadata.name": pod.name, "status.podIP": "10.1.2.3"}
    assert path in known, f"{pod.name}: downward API field {path} is not checked here"
    return known[path]


def container_env(pod: Pod, c: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    if pod.workload["kind"] == "Job" and pod.workload["spec"].get("completionMode") == "Indexed":
        env["JOB_COMPLETION_INDEX"] = str(pod.index)  # the Job controller adds it to every container
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        else:
            ref = e["valueFrom"]
            assert set(ref) == {"fieldRef"}, f"{pod.name}: env {e['name']}: only the downward API is used"
            env[e["name"]] = _downward(pod, ref["fieldRef"]["fieldPath"])
    return env


def _client_env(p: Proc) -> dict[str, str]:
    return {k: v for k, v in p.env.items() if k.startswith("PS_CLIENT_")}


def parse_process(p: Proc, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill ``p.program`` and ``p.config`` through the real parser of what the container runs."""
    exe, args = p.argv[0], p.argv[1:]
    if exe == "ps-server":
        flags = {opt for action in build_parser()._actions for opt in action.option_strings}
        unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in flags]
        assert not unknown, f"{p.pod.name}: ps-server has no {unknown}"
        p.program, p.config = "ps-server", load_config(args, p.env)  # unknown PS_* variables raise
        return
    if exe == "ps-infer":
        p.program, p.config = "ps-infer", load_settings(InferConfig, args, p.env, INFER_PREFIX, "ps-infer")
    elif exe == "torchrun":
        p.torchrun = torchrun_parser().parse_args(args)
        assert p.torchrun.module and p.torchrun.training_script == "deploy.train", p.argv
        script = p.torchrun.training_script_args
        p.program, p.config = "trainer", load_settings(TrainerConfig, script, p.env, TRAINER_PREFIX, "deploy.train")
    elif exe == "ps-rendezvous":
        p.program, p.config = "ps-rendezvous", rendezvous_args(args)
        return
    elif exe == "ps-admin":
        # Its parser reads defaults ($PS_ADDRESSES, $SERVING_ADDRESSES) from the environment.
        errors = io.StringIO()
        with monkeypatch.context() as m, contextlib.redirect_stderr(errors):
            for name, value in p.env.items():
                m.setenv(name, value)
            try:
                p.program, p.config = "ps-admin", admin_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{p.pod.name}: ps-admin refuses {args}: {errors.getvalue().strip()}")
    elif exe == "sh" and p.init:
        p.program = "sh"
        return
    else:
        pytest.fail(f"{p.pod.name}: container {p.container['name']} runs {exe!r}, which this test does not know")
    # A client of the shards reads PS_CLIENT_* when it makes its ClientConfig: each variable
    # set (here to a value of its own) must land in a ClientConfig field.
    p.client_env = _client_env(p)
    with monkeypatch.context() as m:
        for name in p.client_env:
            m.setenv(name, f"/{name}")
        client = ClientConfig()
    values = {str(getattr(client, f.name)) for f in dataclasses.fields(client)}
    unread = [name for name in p.client_env if f"/{name}" not in values]
    assert not unread, f"{p.pod.name}: ClientConfig does not read {unread}"


def processes(resources: list[Resource], monkeypatch: pytest.MonkeyPatch) -> list[Proc]:
    out = []
    for pod in pods(resources):
        for c in containers_of(pod.workload):
            init = c in pod.spec.get("initContainers", [])
            env = container_env(pod, c)
            argv = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
            proc = Proc(pod, c, init, argv, env)
            parse_process(proc, monkeypatch)
            out.append(proc)
    return out


def procs_of(procs: list[Proc], program: str, workload: str | None = None) -> list[Proc]:
    return [p for p in procs if p.program == program and workload in (None, p.pod.workload["metadata"]["name"])]


def mount_source(pod: Pod, c: dict[str, Any], path: PurePosixPath) -> tuple[dict[str, Any], dict[str, Any]]:
    """The volumeMount under which ``path`` lies (the deepest), and its volume."""
    mounts = [m for m in c.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])]
    assert mounts, f"{pod.name}: {path} is on no volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    return mount, volumes[mount["name"]]


def token_role(p: Proc, path: str) -> str | None:
    """The role the shards give the token in the file ``path`` of ``p``'s container: the
    Secret key mounted there, looked up (in secrets.example.yaml, whose placeholder tokens
    are distinct) in the shards' ``shard-tokens``."""
    examples = {s["metadata"]["name"]: s["stringData"] for s in load_resources(K8S / "secrets.example.yaml")}
    mount, volume = mount_source(p.pod, p.container, PurePosixPath(path))
    secret = volume["secret"]
    rel = str(PurePosixPath(path).relative_to(mount["mountPath"]))
    keys = {i["path"]: i["key"] for i in secret.get("items", [])} or {k: k for k in examples[secret["secretName"]]}
    data = examples[secret["secretName"]]
    assert rel in keys and keys[rel] in data, f"{p.pod.name}: {path} is no key of the Secret {secret['secretName']}"
    with tempfile.TemporaryDirectory() as tmp:  # the file as mounted, read as the client reads it
        (Path(tmp) / rel).write_text(data[keys[rel]])
        token = read_client_token(Path(tmp) / rel)
    assert token is not None
    return Tokens.parse(examples["ps-tokens"]["shard-tokens"], "shard-tokens").role_of(token)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def container_ports(c: dict[str, Any]) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in c.get("ports", [])}


def selects(selector: dict[str, str], pod: Pod) -> bool:
    return all(pod.labels.get(k) == v for k, v in selector.items())


def service_of(resources: list[Resource], pod: Pod, container_port: int) -> tuple[Resource, int]:
    """The Service that selects ``pod`` and exposes ``container_port``, and its port there."""
    found = []
    ports = {n: p for c in pod.spec["containers"] for n, p in container_ports(c).items()}
    for s in (r for r in resources if r["kind"] == "Service"):
        if selects(s["spec"]["selector"], pod):
            for sp in s["spec"]["ports"]:
                target = sp.get("targetPort", sp["port"])
                if ports.get(target, target) == container_port:
                    found.append((s, sp["port"]))
    assert len(found) == 1, f"{pod.name}: {len(found)} Services expose port {container_port}"
    return found[0]


def stable_address(resources: list[Resource], statefulset: str, i: int, listen: str) -> str:
    """What clients must dial for pod ``i`` of ``statefulset``: its name under the headless Service."""
    sts = find_resource(resources, "StatefulSet", statefulset)
    pod = next(p for p in pods([sts]) if p.index == i)
    service, port = service_of(resources, pod, port_of(listen))
    assert service["metadata"]["name"] == sts["spec"]["serviceName"] and service["spec"]["clusterIP"] == "None"
    return f"{pod.name}.{service['metadata']['name']}.{NS}.svc:{port}"


# --- the serving shards: a Deployment of replicas each (deploy/k8s/serve)

SHARD_LABEL = "embedding-ps/shard"  # a serving replica's shard index (serve/N sets it)


def serving_deployments(resources: list[Resource]) -> list[Resource]:
    """The serving shards' Deployments, in the order the kustomization lists them."""
    component = "app.kubernetes.io/component"
    return [r for r in resources if r["kind"] == "Deployment" and r["metadata"]["labels"].get(component) == "serve"]


def replicas_address(resources: list[Resource], deployment: str, listen: str) -> str:
    """What clients name for every ready replica of ``deployment``: ``dns:`` and the name of
    the headless Service that lists its pods, and no other workload's, once ready."""
    d = find_resource(resources, "Deployment", deployment)
    pod = next(pods([d]))
    service, port = service_of(resources, pod, port_of(listen))
    name, spec = service["metadata"]["name"], service["spec"]
    assert spec["clusterIP"] == "None", f"{name}: headless, one address per replica"
    assert not spec.get("publishNotReadyAddresses"), f"{name}: a replica still loading must not be listed"
    others = [
        w["metadata"]["name"]
        for w in resources
        if w is not d and pod_template(w) is not None and selects(spec["selector"], next(pods([w])))
    ]
    assert not others, f"{name} lists the pods of {others} too"
    return f"dns:{name}.{NS}.svc:{port}"


def add_serving_shard(root: Path, i: int) -> None:
    """Write ``root/serve/i`` as serve/N's comment says: a copy of serve/0 with ``i`` written
    for the index in both values."""
    text = (root / "serve" / "0" / "kustomization.yaml").read_text()
    assert text.count('"-0"') == 1 and text.count('"0"') == 1, "the index is written once in each value"
    (root / "serve" / str(i)).mkdir()
    (root / "serve" / str(i) / "kustomization.yaml").write_text(
        text.replace('"-0"', f'"-{i}"').replace('"0"', f'"{i}"')
    )
