"""deploy/k8s/scale: the Job ps-scale, which runs ``ps-admin scale`` on the cluster deploy/k8s
runs. Offline.

It is built as kustomize builds it (tests/unit/k8s_model.py), with and without its TLS
component, and validated against the Kubernetes API schema (strict). Its command line goes
through ps-admin's own parser, so a renamed flag fails here. Its lists are checked against the
cluster: the lists before are deploy/k8s/kustomization.yaml's, and each entry after names what
the grow adds at that place, which ``ps-admin scale`` takes in: the training shard pod
``kubectl scale`` starts (its headless Service, the port its ps-server listens on), and the
serving shard a new directory serve/N starts (``dns:`` and its headless Service, which lists its
replicas). With TLS on, its files come from the Secrets the cluster uses and its token has the
role the Reshard RPC needs.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy.admin import main as admin_main
from protos.rpc.auth import allows
from protos.services import PS_SERVICE
from ps.service.server import ROLES as SHARD_ROLES
from tests.unit.k8s_model import (
    K8S,
    K8S_VERSIONS,
    NS,
    VARIANTS,
    Proc,
    Resource,
    add_serving_shard,
    build,
    built,
    containers_of,
    expand,
    find_resource,
    mount_source,
    pod_template,
    processes,
    procs_of,
    replicas_address,
    stable_address,
    token_role,
)

SCALE = K8S / "scale"
LISTS = {  # the literal of the kustomization's block -> the Job's variable it sets
    "training-addresses": "SCALE_ADDRESSES",
    "training-to": "SCALE_TO",
    "serving-addresses": "SCALE_SERVING_ADDRESSES",
    "serving-to": "SCALE_SERVING_TO",
}


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def resources(variant: str) -> list[Resource]:
    return copy.deepcopy(built(variant, SCALE))


def _admin(resources: list[Resource], monkeypatch: pytest.MonkeyPatch) -> Proc:
    (p,) = processes(resources, monkeypatch)
    assert p.program == "ps-admin" and p.config.command == "scale", p.argv
    return p


@pytest.fixture
def admin(resources: list[Resource], monkeypatch: pytest.MonkeyPatch) -> Proc:
    return _admin(resources, monkeypatch)


def _literals(directory: Path) -> dict[str, str]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    (generator,) = k["configMapGenerator"]
    return dict(lit.split("=", 1) for lit in generator["literals"])


def _addresses(literal: str) -> list[str]:
    """A list of the kustomization as the pod sees it ($(POD_NAMESPACE) expanded)."""
    return expand(literal, {"POD_NAMESPACE": NS}).split(",")


# --- the build


def test_one_job_of_the_clusters_image(resources: list[Resource]) -> None:
    assert [(r["kind"], r["metadata"]["name"]) for r in resources] == [("Job", "ps-scale")]
    (job,) = resources
    assert "namespace" not in job["metadata"], "it runs in the namespace it is applied to, the cluster's"
    images = [yaml.safe_load((d / "kustomization.yaml").read_text())["images"] for d in (K8S, SCALE)]
    assert images[0] == images[1], "the image the cluster runs"
    (c,) = containers_of(job)
    (shard,) = containers_of(find_resource(built("plain"), "StatefulSet", "ps-shard"))
    assert c["image"] == shard["image"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_resources_match_the_api_schema(resources: list[Resource], version: str) -> None:
    for r in resources:
        try:
            kubernetes_validate.validate(r, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{r['kind']}/{r['metadata']['name']} (Kubernetes {version}): {exc.message} at {list(exc.path)}"
            )


def test_the_lists_are_set_in_one_block(admin: Proc) -> None:
    # Every list comes from the block an operator edits, through the replacements; job.yaml
    # repeats the same values for `kubectl apply -f`.
    literals = _literals(SCALE)
    assert set(literals) == set(LISTS)
    raw = {e["name"]: e.get("value") for e in admin.container["env"]}
    plain = yaml.safe_load((SCALE / "job.yaml").read_text())
    (c,) = plain["spec"]["template"]["spec"]["containers"]
    written = {e["name"]: e.get("value") for e in c["env"]}
    for key, var in LISTS.items():
        assert raw[var] == literals[key] == written[var], var
        assert f"$({var})" in " ".join(admin.container["args"]), f"{var} is set but passed to no flag"


# --- the command line, through ps-admin's parser


def test_the_job_moves_the_running_cluster(admin: Proc) -> None:
    args = admin.config
    literals = _literals(SCALE)
    assert args.addresses == [[a] for a in _addresses(literals["training-addresses"])]
    assert args.to == _addresses(literals["training-to"])
    assert args.serving_addresses == [[a] for a in _addresses(literals["serving-addresses"])]
    assert args.serving_to == [[a] for a in _addresses(literals["serving-to"])]
    assert args.abort is False, "--abort is added by hand, to undo a scale"
    # Moving large tables takes hours; a run that reaches its limit only ends the run.
    assert args.timeout_s >= 12 * 3600


def test_the_lists_before_are_the_clusters(admin: Proc, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _literals(K8S)
    args = admin.config
    assert [a for (a,) in args.addresses] == _addresses(cluster["training-addresses"])
    assert [a for (a,) in args.serving_addresses] == _addresses(cluster["serving-addresses"])
    resources = built("plain")
    servers = procs_of(processes(copy.deepcopy(resources), monkeypatch), "ps-server")
    listen = {(p.config.mode, p.config.shard): p.config.listen for p in servers}
    training = [stable_address(resources, "ps-shard", i, listen["train", i]) for i in range(len(args.addresses))]
    assert [a for (a,) in args.addresses] == training
    serving = [
        replicas_address(resources, f"ps-serve-{i}", listen["serve", i]) for i in range(len(args.serving_addresses))
    ]
    assert [a for (a,) in args.serving_addresses] == serving


def _shrink(k: dict[str, Any]) -> None:
    # What an operator writes for a shrink: the -to lists the first shard of the lists now.
    literals = dict(lit.split("=", 1) for lit in k["configMapGenerator"][0]["literals"])
    for key in ("training", "serving"):
        literals[f"{key}-to"] = literals[f"{key}-addresses"].split(",")[0]
    k["configMapGenerator"][0]["literals"] = [f"{key}={value}" for key, value in literals.items()]


@pytest.mark.parametrize("edit", [None, _shrink], ids=["as-shipped", "shrink"])
def test_the_lists_after_name_the_shards_a_grow_adds(
    edit: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = _admin(build(SCALE, edit), monkeypatch).config
    before, after = [a for (a,) in args.addresses], list(args.to)
    n, m = len(before), len(after)
    assert after[: min(n, m)] == before[: min(n, m)] and n != m, "a grow appends shards, a shrink keeps a prefix"
    assert [len(s) for s in args.serving_to] == [1] * m, "one entry per serving shard: all its replicas"

    # The cluster as the grow's first steps leave it (docs/guides/kubernetes.md): `kubectl scale
    # statefulset ps-shard --replicas=M` (more pods of the same template, whose PS_NUM_SHARDS
    # still says N), and each new serving shard's directory serve/i applied on its own.
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    resources = copy.deepcopy(built("plain"))
    find_resource(resources, "StatefulSet", "ps-shard")["spec"]["replicas"] = max(n, m)
    for i in range(n, m):
        add_serving_shard(root, i)
        resources += build(root / "serve" / str(i))
    servers = procs_of(processes(resources, monkeypatch), "ps-server")
    train = {p.config.shard: p for p in servers if p.config.mode == "train"}
    serve = {p.config.shard: p for p in servers if p.config.mode == "serve"}
    for i in range(m):
        assert after[i] == stable_address(resources, "ps-shard", i, train[i].config.listen), f"--to place {i}"
        (serving,) = args.serving_to[i]
        name = serve[i].pod.workload["metadata"]["name"]
        assert serving == replicas_address(resources, name, serve[i].config.listen), f"--serving-to {i}"
        assert serve[i].config.follow == after[i], f"{name} follows the training shard at place {i}"
    for i in range(n, m):
        # What ps-admin scale takes in at place i: shard i, a spare (past the end of its cluster)
        # or numbered for the new one (deploy.scale checks the same against GetMap); so are the
        # new serving shard's replicas.
        for c in (train[i].config, serve[i].config):
            assert c.shard == i and (c.shard >= c.num_shards or c.num_shards == m), f"place {i}: {c}"


# --- retries, security


def test_a_failed_run_is_run_again_and_bad_arguments_are_not(resources: list[Resource]) -> None:
    (job,) = resources
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1, "running it again finishes an interrupted scale"
    assert "activeDeadlineSeconds" not in spec, "a deadline would stop a long move"
    assert spec["ttlSecondsAfterFinished"] >= 3600, "its log stays a while"
    assert spec["template"]["spec"]["restartPolicy"] == "Never", "podFailurePolicy needs it"
    rules = spec["podFailurePolicy"]["rules"]
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    assert fail["onExitCodes"]["containerName"] == "ps-admin"
    assert fail["onExitCodes"]["operator"] == "In"
    # ... and ps-admin does exit 2 on bad arguments
    with pytest.raises(SystemExit) as exc:
        admin_main(["scale", "--addresses", "h:1", "--to", "h:1+h:2"])
    assert exc.value.code in fail["onExitCodes"]["values"]
    ignored = [c for r in rules if r["action"] == "Ignore" for c in r["onPodConditions"]]
    assert {"type": "DisruptionTarget", "status": "True"} in ignored, "a drained node's pod is run again, uncounted"


def test_it_runs_as_the_cluster_pods_do(resources: list[Resource]) -> None:
    shard = pod_template(find_resource(built("plain"), "StatefulSet", "ps-shard"))
    assert shard is not None
    (job,) = resources
    template = pod_template(job)
    assert template is not None
    assert template["spec"]["securityContext"] == shard["spec"]["securityContext"]
    (c,) = template["spec"]["containers"]
    assert c["securityContext"] == shard["spec"]["containers"][0]["securityContext"]
    for kind in ("requests", "limits"):
        assert set(c["resources"][kind]) == {"cpu", "memory"}


def test_tls_files_and_token_reach_the_shards(variant: str, admin: Proc) -> None:
    keys = {"PS_CLIENT_TLS_CA", "PS_CLIENT_TLS_CERT", "PS_CLIENT_TLS_KEY", "PS_CLIENT_TOKEN_FILE"}
    assert set(admin.client_env) == (keys if variant == "tls" else set())
    if variant != "tls":
        return
    cluster = find_resource(built("tls"), "StatefulSet", "ps-shard")["spec"]["template"]["spec"]["volumes"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in cluster if "secret" in v}
    for name in keys:
        mount, volume = mount_source(admin.pod, admin.container, PurePosixPath(admin.client_env[name]))
        assert mount.get("readOnly") is True
        assert volume["secret"]["secretName"] == secrets[mount["name"]], "the Secrets the shards use"
    role = token_role(admin, admin.client_env["PS_CLIENT_TOKEN_FILE"])
    for method in ("GetMap", "Reshard"):
        needed = SHARD_ROLES[f"/{PS_SERVICE}/{method}"]
        assert role is not None and allows(role, needed), f"{method} needs {needed}, the Job's token is {role}"
