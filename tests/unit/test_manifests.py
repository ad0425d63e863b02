"""deploy/: the Kubernetes manifests and the Dockerfile agree with the API schemas, with each
other, and with the programs they start. Offline.

What ``kubectl apply -k deploy/k8s`` would create is built here as kustomize builds it (the
kustomization's resources, the serving shards' kustomizations among them, generators, images,
replicas, components, patches, name suffixes, labels and replacements; a key this builder does
not know fails the test rather than being skipped), with and without the TLS component. Every
resource is validated against the Kubernetes API schema (strict: unknown fields are errors). Then
each pod is expanded as the cluster would run it (ordinal, pod-index label, downward API,
``$(VAR)`` references) and each container's command line and environment go through the real
parser of its program: ``ps.service.config.load_config`` for ps-server, ``load_settings(InferConfig)``
for ps-infer, torch's own torchrun parser and ``load_settings(TrainerConfig)`` for the trainer,
and ``ClientConfig`` for the ``PS_CLIENT_*`` settings. The wiring checks read those parsed
configs: a renamed flag, or a shard count changed in one place only, fails here rather than in a
cluster. What Prometheus scrapes, the Grafana dashboard, and the autoscalers with the
prometheus-adapter rule they scale by are checked in ``test_monitoring_manifests``. (For both
variants the builder's output was compared with ``kubectl kustomize`` 5.5's and is the same.)
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from client import ClientConfig, parse_addresses
from protos.rpc.auth import allows
from protos.services import PS_SERVICE
from ps.durability import checkpoint_target, resolve_existing_checkpoint
from ps.service.server import ROLES as SHARD_ROLES
from tests.unit.k8s_model import (
    JOB_UID,
    K8S,
    K8S_VERSIONS,
    NS,
    ROOT,
    SHARD_LABEL,
    VARIANTS,
    Proc,
    Resource,
    add_serving_shard,
    build,
    built,
    container_ports,
    containers_of,
    find_resource,
    kustomization_files,
    load_resources,
    mount_source,
    pod_template,
    pods,
    port_of,
    processes,
    procs_of,
    replicas_address,
    selects,
    service_of,
    serving_deployments,
    stable_address,
    token_role,
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


# --- files and schemas


def test_every_yaml_file_is_built_or_an_example() -> None:
    # deploy/k8s, and the scale Job in deploy/k8s/scale (tests/unit/test_scale_manifests.py)
    used = {K8S / "secrets.example.yaml"} | kustomization_files(K8S, ["tls"])
    used |= kustomization_files(K8S / "scale", ["tls"])
    files = set(K8S.rglob("*.yaml")) | set(K8S.rglob("*.yml"))
    assert files == used, f"not built and not an example: {sorted(map(str, files - used))}"
    for directory in (K8S, K8S / "scale"):
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert k.get("components") is None, f"{directory}: TLS is off by default: the Secrets must exist first"
    for path in files:
        load_resources(path)  # every file parses


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_resources_match_the_api_schema(resources: list[Resource], version: str) -> None:
    examples = load_resources(K8S / "secrets.example.yaml")
    for r in resources + examples:
        try:
            kubernetes_validate.validate(r, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{r['kind']}/{r['metadata']['name']} (Kubernetes {version}): {exc.message} at {list(exc.path)}"
            )


def test_every_container_is_a_program_of_the_image(procs: list[Proc]) -> None:
    # The fixture ran every container through its program's parser (and fails on one it does
    # not know); all of them come from the one image deploy/Dockerfile builds.
    kinds = {p.program for p in procs}
    assert kinds == {"ps-server", "ps-infer", "trainer", "ps-rendezvous", "sh"}, kinds
    for p in procs:
        assert p.container["image"] == "embedding-ps:0.1.0"


# --- shards


def _serving(procs: list[Proc]) -> list[Proc]:
    """The serving shards' ps-server processes: one replica of each shard, in shard order."""
    return [p for p in procs_of(procs, "ps-server") if p.pod.labels["app.kubernetes.io/component"] == "serve"]


def test_shards_and_followers_line_up(resources: list[Resource], procs: list[Proc]) -> None:
    train, serve = procs_of(procs, "ps-server", "ps-shard"), _serving(procs)
    n = find_resource(resources, "StatefulSet", "ps-shard")["spec"]["replicas"]
    # One serving shard per training shard, in order: the Deployment ps-serve-i, whose replicas
    # are serving shard i (the label serve/i gives them).
    deployments = [d["metadata"]["name"] for d in serving_deployments(resources)]
    assert n >= 1 and deployments == [f"ps-serve-{i}" for i in range(n)], deployments
    assert [p.config.shard for p in train] == list(range(n)) == [p.config.shard for p in serve]
    for p in train:
        assert (p.config.num_shards, p.config.mode, p.config.follow) == (n, "train", None)
    for p in serve:
        i = p.config.shard
        leader = stable_address(resources, "ps-shard", i, train[i].config.listen)
        assert (p.config.num_shards, p.config.mode, p.config.follow) == (n, "serve", leader), p.pod.name
        assert p.pod.labels[SHARD_LABEL] == str(i) and p.pod.workload["metadata"]["name"] == f"ps-serve-{i}"


def test_shard_data_lives_on_its_own_volume(resources: list[Resource], procs: list[Proc]) -> None:
    sts = find_resource(resources, "StatefulSet", "ps-shard")
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    for p in procs_of(procs, "ps-server", "ps-shard"):
        mounts = [m for m in p.container["volumeMounts"] if m["name"] in claims]
        assert p.config.data_dir is not None and any(
            PurePosixPath(p.config.data_dir).is_relative_to(m["mountPath"]) for m in mounts
        ), f"{p.pod.name}: data dir {p.config.data_dir} is not on a volumeClaimTemplate"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"


def test_rescue_dumps_go_to_a_volume_of_their_own_that_outlives_the_pod(
    resources: list[Resource], procs: list[Proc]
) -> None:
    # A shard stopping while its data volume is full saves the acknowledged updates it could
    # not write to --rescue-dir: on the data volume (or with none set, where every fallback
    # is on it) the dump fails too and the updates are lost. The next start of the shard
    # applies the dump, maybe in a new pod on another node (eviction, drain): an emptyDir
    # would be gone with the old pod, a claim of the StatefulSet follows the shard index.
    sts = find_resource(resources, "StatefulSet", "ps-shard")
    claims = {t["metadata"]["name"]: t for t in sts["spec"]["volumeClaimTemplates"]}
    for p in procs_of(procs, "ps-server", "ps-shard"):
        assert p.config.rescue_dir is not None, f"{p.pod.name}: no --rescue-dir, so a full data volume loses updates"
        (data_mount, rescue_mount) = (
            max(
                (m for m in p.container["volumeMounts"] if PurePosixPath(path).is_relative_to(m["mountPath"])),
                key=lambda m: len(m["mountPath"]),
            )
            for path in (p.config.data_dir, p.config.rescue_dir)
        )
        assert rescue_mount["name"] != data_mount["name"], f"{p.pod.name}: rescue dumps on the data volume"
        assert rescue_mount["name"] in claims, f"{p.pod.name}: {rescue_mount['name']} is not a volumeClaimTemplate"
        assert not rescue_mount.get("readOnly")
        size = _bytes(claims[rescue_mount["name"]]["spec"]["resources"]["requests"]["storage"])
        assert size >= p.config.memory_budget_bytes, f"{p.pod.name}: a dump holds up to the RAM budget of rows"


def _claim_mount(resources: list[Resource], p: Proc, path: PurePosixPath) -> tuple[dict[str, Any], Resource]:
    """The mount ``path`` lies under in ``p``'s container and the PersistentVolumeClaim it is."""
    mount, volume = mount_source(p.pod, p.container, path)
    assert "persistentVolumeClaim" in volume, f"{p.pod.name}: {path} is on {volume}, not a PersistentVolumeClaim"
    return mount, find_resource(resources, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_serving_shards_read_the_checkpoints_training_writes(
    resources: list[Resource], procs: list[Proc], tmp_path: Path
) -> None:
    # `ps-admin serve-from --checkpoint NAME` pins serving shard i to the part training shard
    # i wrote: every shard, training and serving, needs the one checkpoint root, on a volume
    # that pods on different nodes all mount.
    train, serve = procs_of(procs, "ps-server", "ps-shard"), _serving(procs)
    roots = set()
    for p in train + serve:
        root = p.config.checkpoint_root
        assert root is not None, f"{p.pod.name}: no --checkpoint-root, so serve-from finds no checkpoint"
        mount, claim = _claim_mount(resources, p, PurePosixPath(root))
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], f"{p.pod.name}: pods on other nodes mount it too"
        # Opening a RocksDB checkpoint, even read-only, rewrites a file in it (rocksdict's config).
        assert not mount.get("readOnly"), f"{p.pod.name}: a read-only mount refuses serve-from"
        assert PurePosixPath(root) != PurePosixPath(mount["mountPath"]), "a directory inside the volume (lost+found)"
        roots.add((str(root), claim["metadata"]["name"], mount["mountPath"]))
    assert len(roots) == 1, f"one checkpoint root for every shard (one NAME, one cluster manifest): {roots}"
    ((root, claim_name, mount_path),) = roots

    # Through the shards' own code, with the claim as a directory here: the part each training
    # shard writes is the one its serving shard finds.
    host = tmp_path / claim_name / PurePosixPath(root).relative_to(mount_path)
    n = len(train)
    parts = {}
    for p in train:
        parts[p.config.shard] = part = checkpoint_target(host, "v1", p.config.shard, n)
        (part / "db").mkdir(parents=True)
        (part / "manifest.json").write_text("{}")
    for p in serve:
        assert resolve_existing_checkpoint(host, "v1", p.config.shard, n) == parts[p.config.shard], p.pod.name


def test_memory_budget_fits_the_limit(procs: list[Proc]) -> None:
    for p in procs_of(procs, "ps-server"):
        limit = _bytes(p.container["resources"]["limits"]["memory"])
        assert 0 < p.config.memory_budget_bytes <= 0.8 * limit, f"{p.pod.name}: leave RAM beside the rows"


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity)
    assert m and (m.group(2) in units or not m.group(2)), quantity
    return int(m.group(1)) * units.get(m.group(2), 1)


# --- clients name one address per shard


def test_clients_name_every_shard_in_order(resources: list[Resource], procs: list[Proc]) -> None:
    train = {p.config.shard: p.config.listen for p in procs_of(procs, "ps-server", "ps-shard")}
    serve = {p.config.shard: p for p in _serving(procs)}
    n = len(train)
    for p in procs_of(procs, "trainer"):
        want = [stable_address(resources, "ps-shard", i, train[i]) for i in range(n)]
        assert parse_addresses(",".join(p.config.addresses)) == [[a] for a in want], p.pod.name
    # ps-infer names each serving shard once, by the headless Service that lists its replicas.
    replicas = [
        replicas_address(resources, serve[i].pod.workload["metadata"]["name"], serve[i].config.listen) for i in range(n)
    ]
    for p in procs_of(procs, "ps-infer"):
        assert p.config.addresses() == [[a] for a in replicas], p.pod.name
    # A serving replica's peers are its own shard's replicas (it takes their serving map).
    for i, p in serve.items():
        assert p.config.serving_peers == (replicas[i],), p.pod.name


def _three_addresses(literal: str) -> str:
    key, _, addresses = literal.partition("=")
    first = addresses.split(",")[0]
    return key + "=" + ",".join(first.replace("-0.", f"-{i}.", 1) for i in range(3))


def _three_shards(root: Path, serving_directory: bool = True, lists: bool = True) -> list[Resource]:
    """deploy/k8s copied to ``root`` and changed to 3 shards as the kustomization tells a person
    to: `count`, the directory serve/2 (and listed), both lists; or with one of them forgotten."""
    shutil.copytree(K8S, root)
    add_serving_shard(root, 2)

    def edit(k: dict[str, Any]) -> None:
        k["replicas"][0]["count"] = 3
        if serving_directory:
            k["resources"].append("serve/2")
        if lists:
            generator = k["configMapGenerator"][0]
            generator["literals"] = [_three_addresses(literal) for literal in generator["literals"]]

    return build(root, edit)


def test_shard_count_changes_in_one_place(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    resources = _three_shards(tmp_path / "k8s")
    procs = processes(resources, monkeypatch)
    assert [p.config.shard for p in _serving(procs)] == [0, 1, 2]
    assert {p.config.num_shards for p in procs_of(procs, "ps-server")} == {3}
    test_shards_and_followers_line_up(resources, procs)
    test_clients_name_every_shard_in_order(resources, procs)


@pytest.mark.parametrize("forgotten", ["serving-directory", "lists"])
def test_a_shard_count_changed_in_part_fails_here(
    forgotten: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # kustomize has no loop: a serving shard is a directory listed once per shard. Forgetting it
    # (or the lists) must fail here, not leave shard 2 without serving replicas in a cluster.
    resources = _three_shards(
        tmp_path / "k8s", serving_directory=forgotten != "serving-directory", lists=forgotten != "lists"
    )
    procs = processes(resources, monkeypatch)
    with pytest.raises(AssertionError):
        test_shards_and_followers_line_up(resources, procs)
        test_clients_name_every_shard_in_order(resources, procs)


def test_serving_shards_are_listed_once_each_in_order() -> None:
    # serve/i is serve/0 with its index changed, as its comment tells a person to write it, and
    # the kustomization lists serve/0 ... serve/N-1 for its N training shards, and no others.
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    n = k["replicas"][0]["count"]
    assert [r for r in k["resources"] if r.startswith("serve")] == [f"serve/{i}" for i in range(n)]
    assert sorted(d.name for d in (K8S / "serve").iterdir()) == sorted(["base", *map(str, range(n))])
    template = (K8S / "serve" / "0" / "kustomization.yaml").read_text()
    for i in range(n):
        want = template.replace('"-0"', f'"-{i}"').replace('"0"', f'"{i}"')
        assert (K8S / "serve" / str(i) / "kustomization.yaml").read_text() == want, f"serve/{i}"


# --- services, probes, shutdown


def test_services_select_their_pods_and_ports(resources: list[Resource]) -> None:
    workloads = [r for r in resources if pod_template(r) is not None]
    for s in (r for r in resources if r["kind"] in ("Service", "PodDisruptionBudget")):
        selector = s["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        chosen = [w for w in workloads if selects(selector, next(pods([w])))]
        assert len(chosen) == 1, f"{s['kind']}/{s['metadata']['name']} selects {len(chosen)} workloads"
        if s["kind"] == "PodDisruptionBudget":
            continue
        declared = {
            n: p for c in chosen[0]["spec"]["template"]["spec"]["containers"] for n, p in container_ports(c).items()
        }
        for sp in s["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            assert target in declared or target in declared.values(), f"{s['metadata']['name']}: no port {target}"
    sts = find_resource(resources, "StatefulSet", "ps-shard")
    service = find_resource(resources, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "ps-shard: its Service must be headless (a name per pod)"
    assert selects(service["spec"]["selector"], next(pods([sts])))
    for d in serving_deployments(resources):  # a headless Service of its own, listing its replicas
        (server,) = d["spec"]["template"]["spec"]["containers"]
        replicas_address(resources, d["metadata"]["name"], f"0.0.0.0:{container_ports(server)['grpc']}")
    # Voluntary disruptions (node drains, upgrades) take one training shard or ps-infer pod at a
    # time (clients retry a missing training shard), and leave every serving shard one replica.
    budgets = {r["metadata"]["name"]: r["spec"] for r in resources if r["kind"] == "PodDisruptionBudget"}
    assert budgets["ps-shard"]["maxUnavailable"] == 1 and budgets["ps-infer"]["maxUnavailable"] == 1
    for d in serving_deployments(resources):
        budget = budgets.pop(d["metadata"]["name"])
        assert budget["minAvailable"] == 1 and "maxUnavailable" not in budget, d["metadata"]["name"]
        assert budget["selector"] == d["spec"]["selector"], "this shard's replicas, and only them"
    assert set(budgets) == {"ps-shard", "ps-infer"}


def _probes(c: dict[str, Any]) -> list[dict[str, Any]]:
    return [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]


def test_probes_ask_the_grpc_port(procs: list[Proc]) -> None:
    for p in procs_of(procs, "ps-server") + procs_of(procs, "ps-infer"):
        probes = _probes(p.container)
        assert len(probes) == 3, f"{p.pod.name}: startup, readiness and liveness probes"
        port = port_of(p.config.listen)
        assert container_ports(p.container)["grpc"] == port
        for probe in probes:
            if p.config.tls_cert is None:
                # grpc.health.v1: service "" is the server's overall status
                assert probe["grpc"]["port"] == port and probe["grpc"].get("service", "") == "", probe
            else:  # the kubelet's gRPC probe speaks plaintext only: it would fail against TLS
                assert "grpc" not in probe and probe["tcpSocket"]["port"] == port, probe


def test_ps_infer_waits_for_loading_shards_within_its_startup_probe(procs: list[Proc]) -> None:
    # ps-infer listens only once its shards have loaded (--wait-s): the kubelet must not kill
    # it for not answering meanwhile, or a pod that would have served crash-loops instead.
    for p in procs_of(procs, "ps-infer"):
        probe = p.container["startupProbe"]
        window_s = probe["periodSeconds"] * probe["failureThreshold"]
        assert 0 < p.config.wait_s < window_s, f"{p.pod.name}: --wait-s {p.config.wait_s}, probe window {window_s} s"


def test_serving_replicas_may_load_a_large_snapshot(procs: list[Proc]) -> None:
    # A serving replica's health is NOT_SERVING until it holds its training shard's snapshot
    # (0.33M rows/s measured): its startup probe must wait that long, not restart it meanwhile.
    for p in _serving(procs):
        probe = p.container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60, p.pod.name


def _pre_stop_s(c: dict[str, Any]) -> int:
    if "lifecycle" not in c:
        return 0
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def test_shutdown_fits_the_grace_period(procs: list[Proc]) -> None:
    for p in procs_of(procs, "ps-server") + procs_of(procs, "ps-infer"):
        # On SIGTERM a server drains (NOT_SERVING, still answering) for drain_s, lets calls in
        # flight finish for grace_s, and ps-server may retry a refused final write for grace_s more.
        stop_s = p.config.drain_s + p.config.grace_s * (2 if p.program == "ps-server" else 1)
        period = p.pod.spec["terminationGracePeriodSeconds"]
        assert period > _pre_stop_s(p.container) + stop_s, f"{p.pod.name}: SIGKILL would cut the drain short"
    # A serving replica or ps-infer keeps answering while its clients move away: its drain does
    # what a preStop pause did, long enough for clients to see it (they ask every replica's
    # health each membership_refresh_s).
    for p in _serving(procs) + procs_of(procs, "ps-infer"):
        assert "lifecycle" not in p.container, f"{p.pod.name}: the drain replaces the preStop pause"
        assert p.config.drain_s >= 2 * ClientConfig().membership_refresh_s, p.pod.name


# --- metrics


def _certificate_names() -> list[str]:
    """The DNS names secrets.example.yaml's recipe writes into the certificate, for NS."""
    recipe = (K8S / "secrets.example.yaml").read_text()
    m = re.search(r"subjectAltName=(\S+?)\\n", recipe)
    assert m, "secrets.example.yaml: no subjectAltName in the recipe"
    return [name.replace("%s", NS) for name in re.findall(r"DNS:([^,]+)", m.group(1))]


def _certificate_covers(names: list[str], host: str) -> bool:
    # A wildcard stands for one whole label, the leftmost (RFC 6125).
    return any(host == n or (n.startswith("*.") and host.partition(".")[2] == n[2:]) for n in names)


def test_the_certificate_names_every_host_clients_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # A client checks the server's certificate against the host it dials; for a dns: entry that
    # is the name (the replicas are dialled by address), so the serving shards' Services must be
    # in the certificate, and a grow's new ones too (ps-serve-N: the scale Job's lists).
    resources = copy.deepcopy(built("tls"))
    procs = processes(resources, monkeypatch)
    hosts = set()
    for p in procs_of(procs, "ps-infer"):
        hosts |= {entry.removeprefix("dns:").rpartition(":")[0] for shard in p.config.addresses() for entry in shard}
        service, _ = service_of(resources, p.pod, port_of(p.config.listen))
        hosts.add(f"{service['metadata']['name']}.{NS}.svc")  # what callers dial (kubernetes.md)
    for p in procs_of(procs, "trainer"):
        hosts |= {address.rpartition(":")[0] for address in p.config.addresses}
    hosts |= {p.config.follow.rpartition(":")[0] for p in _serving(procs)}
    hosts.add(f"ps-serve-{len(_serving(procs))}.{NS}.svc")
    names = _certificate_names()
    assert [h for h in sorted(hosts) if not _certificate_covers(names, h)] == [], names


# --- training and serving meet on the model volume


def test_training_workers_meet_at_a_rendezvous_none_of_them_hosts(resources: list[Resource], procs: list[Proc]) -> None:
    # Elastic torchrun: any worker pod may die, so the c10d store lives in a pod of its own
    # (ps-rendezvous) behind a Service, and every agent is a client of it.
    job = find_resource(resources, "Job", "ps-train")
    spec, template = job["spec"], job["spec"]["template"]["spec"]
    (store,) = procs_of(procs, "ps-rendezvous")
    assert store.pod.workload["kind"] == "Deployment" and store.pod.workload["spec"]["replicas"] == 1
    host, _, port = store.config.listen.rpartition(":")
    assert host == "0.0.0.0", "the agents are in other pods"
    service, service_port = service_of(resources, store.pod, int(port))
    workers = procs_of(procs, "trainer")
    assert len(workers) == spec["parallelism"]
    for p in workers:
        args = p.torchrun
        assert args is not None and args.rdzv_backend == "c10d"
        assert args.rdzv_endpoint == f"{service['metadata']['name']}.{NS}.svc:{service_port}", args.rdzv_endpoint
        conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(","))
        assert conf["is_host"] == "false", "no worker hosts the store"
        assert args.local_addr == "10.1.2.3", (
            "other pods reach rank 0 at its pod IP (a Job pod's name does not resolve)"
        )
        low, high = (int(n) for n in args.nnodes.split(":"))
        assert 1 <= low <= spec["parallelism"] <= high, f"--nnodes {args.nnodes}: the Job's pods fit, and may change"
        assert int(args.max_restarts) >= 1 and int(args.nproc_per_node) == 1
        assert args.rdzv_id == JOB_UID, "one rendezvous per Job, the same in a pod that replaces another"
        assert p.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1", "pytorch/pytorch#135712: restarts must not share it"
    # A pod that fails is replaced (or its container restarted) and rejoins; the Job may grow.
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert template["restartPolicy"] == "OnFailure" and spec["backoffLimit"] >= 1


def test_worker_checkpoints_are_shared_by_the_job_and_its_own(procs: list[Proc]) -> None:
    workers = procs_of(procs, "trainer")
    dirs = {p.config.checkpoint_dir for p in workers}
    assert len(dirs) == 1 and None not in dirs, "every pod of a run resumes from the same checkpoints"
    (path,) = dirs
    assert JOB_UID in str(path), "a Job applied anew is a new run, not a resumed one"
    for p in workers:
        assert p.config.checkpoint_every >= 1
        mount, volume = mount_source(p.pod, p.container, PurePosixPath(path))
        assert not mount.get("readOnly")
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert claim != "ps-models", "checkpoints have a volume of their own"
        pvc = find_resource(built("plain"), "PersistentVolumeClaim", claim)
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "rank 0 may run on any node"


def test_ps_infer_serves_what_training_writes(procs: list[Proc]) -> None:
    (trainer, *_) = procs_of(procs, "trainer")
    out = trainer.config.output_dir
    run = PurePosixPath(trainer.container["workingDir"]) / "runs" / "latest" if out is None else PurePosixPath(out)
    _, written = mount_source(trainer.pod, trainer.container, run)
    for p in procs_of(procs, "ps-infer"):
        assert PurePosixPath(p.config.model) == run
        mount, volume = mount_source(p.pod, p.container, run)
        assert volume["persistentVolumeClaim"]["claimName"] == written["persistentVolumeClaim"]["claimName"]
        assert mount.get("readOnly") is True
        (wait,) = [q for q in procs if q.pod is p.pod and q.init]
        assert f"{run}/" in wait.argv[-1], "the init container waits for this run directory"


# --- security


def test_tls_files_come_from_mounted_secrets(procs: list[Proc]) -> None:
    examples = {s["metadata"]["name"]: s for s in load_resources(K8S / "secrets.example.yaml")}
    settings = (
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "auth_token_file",
        "client_tls_ca",
        "client_tls_cert",
        "client_tls_key",
        "client_token_file",
    )
    for p in procs:
        files = [getattr(p.config, s) for s in settings if getattr(p.config, s, None) is not None]
        files += list(p.client_env.values())
        for f in files:
            mount, volume = mount_source(p.pod, p.container, PurePosixPath(f))
            assert mount.get("readOnly") is True, f"{p.pod.name}: {mount['mountPath']} must be read-only"
            secret = volume["secret"]
            rel = str(PurePosixPath(f).relative_to(mount["mountPath"]))
            keys = {i["path"]: i["key"] for i in secret.get("items", [])} or {
                k: k for k in examples[secret["secretName"]]["stringData"]
            }
            assert rel in keys and keys[rel] in examples[secret["secretName"]]["stringData"], f"{p.pod.name}: {f}"


def test_tls_reaches_every_connection(variant: str, procs: list[Proc]) -> None:
    on = variant == "tls"
    for p in procs_of(procs, "ps-server") + procs_of(procs, "ps-infer"):
        assert (p.config.tls_cert is not None and p.config.auth_token_file is not None) == on, p.pod.name
    # A follower is a client of its training shard; in a live reshard (ps-admin scale) a training
    # shard is a client of the others, pulling the rows it takes over from them.
    for p in procs_of(procs, "ps-server"):
        client = (p.config.client_tls_ca, p.config.client_tls_cert, p.config.client_tls_key, p.config.client_token_file)
        assert all(f is not None for f in client) if on else all(f is None for f in client), p.pod.name
    for p in procs_of(procs, "ps-infer") + procs_of(procs, "trainer"):
        keys = {"PS_CLIENT_TLS_CA", "PS_CLIENT_TLS_CERT", "PS_CLIENT_TLS_KEY", "PS_CLIENT_TOKEN_FILE"}
        assert set(p.client_env) == (keys if on else set()), p.pod.name


def test_shards_send_each_other_a_token_the_call_allows(variant: str, procs: list[Proc]) -> None:
    # Follow needs a read token, MoveRows (a reshard's rows) a write token: a weaker one fails
    # only once a follower starts, or in the middle of a scale.
    checked = 0
    for p in procs_of(procs, "ps-server"):
        if p.config.client_token_file is None:
            continue
        method = "Follow" if p.config.mode == "serve" else "MoveRows"
        role = token_role(p, str(p.config.client_token_file))
        needed = SHARD_ROLES[f"/{PS_SERVICE}/{method}"]
        assert role is not None and allows(role, needed), f"{p.pod.name}: {method} needs {needed}, the token is {role}"
        checked += 1
    assert checked == (len(procs_of(procs, "ps-server")) if variant == "tls" else 0)


def _dockerfile() -> tuple[list[str], dict[str, str]]:
    """The Dockerfile's instructions (continuations joined) and its ARG defaults."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "deploy" / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    args = dict(line.split(None, 1)[1].split("=", 1) for line in lines if line.startswith("ARG ") and "=" in line)
    return lines, args


def test_pods_run_as_the_image_user(resources: list[Resource]) -> None:
    lines, _ = _dockerfile()
    (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user.isdigit() and int(user) != 0, "a numeric, non-root USER lets runAsNonRoot verify it"
    for r in resources:
        t = pod_template(r)
        if t is None:
            continue
        ctx = t["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == int(user) == ctx["fsGroup"]
        for c in containers_of(r):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            for kind in ("requests", "limits"):
                assert set(c["resources"][kind]) == {"cpu", "memory"}, f"{r['metadata']['name']}/{c['name']}"


# --- the image


def test_dockerfile_installs_with_the_constraints() -> None:
    lines, args = _dockerfile()
    assert lines[0] == "FROM python:3.11-slim"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    steps = [
        shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), step))
        for line in lines
        if line.startswith("RUN ")
        for step in line[4:].split("&&")
    ]
    pip = [words for words in steps if words[:2] == ["pip", "install"]]
    assert any(words[-1] == "." for words in pip), "the project itself is installed with `pip install ... .`"
    for words in pip:
        assert words[2:4] == ["-c", "constraints.txt"], f"every pip install is constrained: {words}"
        assert words[words.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    copied = {source for line in lines if line.startswith("COPY ") for source in line.split()[1:-1]}
    assert {"constraints.txt", "pyproject.toml"} <= copied
    packages = {p for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"] if "." not in p}
    assert packages <= copied, f"pip install . needs every package: {packages - copied} not copied"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "benchmarks/results", "**/__pycache__"} <= set(ignored)


def test_dockerfile_starts_every_entry_point(resources: list[Resource]) -> None:
    lines, _ = _dockerfile()
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    torch_scripts = {
        e.name for e in importlib.metadata.distribution("torch").entry_points if e.group == "console_scripts"
    }
    checked = set()
    for line in lines:
        if line.startswith("RUN ") and "--help" in line:
            for step in line[4:].split("&&"):
                words = shlex.split(step.split(">")[0])
                if words[:2] == ["python", "-m"]:
                    assert importlib.util.find_spec(words[2]) is not None, words
                    checked.add(f"python -m {words[2]}")
                else:
                    assert words[0] in scripts | torch_scripts, f"{words[0]} is no console script of the image"
                    checked.add(words[0])
    assert {"ps-server", "ps-infer", "ps-admin", "python -m deploy.train"} <= checked, checked
    commands = {c["command"][0] for r in resources for c in containers_of(r)}
    assert commands - {"sh"} <= checked, f"containers run what the build did not try: {commands - checked}"
