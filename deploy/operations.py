"""What ``ps-admin`` does to a running cluster and to checkpoints, as functions
(``deploy.admin`` is its command line around them).

Each call opens one client of the cluster with ``security`` (a ``ClientConfig`` whose TLS
and token the command line filled in; by default the ``PS_CLIENT_*`` environment's) that
waits for no shard: an unreachable shard fails the call at once with an ``AdminError``
that says what to check, instead of the training client's retries.

* ``checkpoint_cluster``: every shard writes its part of one named checkpoint;
  ``list_checkpoints``: offline, what checkpoint roots hold.
* ``cluster_stats``, ``cluster_tables``, ``create_table``, ``cluster_health``.
* ``scale_cluster``: a live reshard of a running cluster (``deploy.scale``) over gRPC.

Example:
    >>> list_checkpoints([])
    []
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import CheckpointError, ClientConfig, PSClient, PSError, ShardUnavailableError
from client.admin import ShardByAddress
from client.errors import tls_hint
from client.membership import addresses_of
from deploy.reshard import AdminError, now_stamp, shard_dir_name
from deploy.scale import RetryLater, ScaleReport, scale
from protos import ps_pb2 as pb
from protos.rpc.backoff import Backoff
from protos.rpc.security import CallerSecurity
from protos.rpc.tls import open_channel
from protos.services import SHARD_HEALTH
from ps.store import FORMAT_VERSION, DataDirError, StorageFailed, read_manifest, write_manifest

__all__ = [
    "GrpcShards",
    "checkpoint_cluster",
    "cluster_health",
    "cluster_stats",
    "cluster_tables",
    "create_table",
    "list_checkpoints",
    "open_cluster",
    "scale_cluster",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


@contextlib.contextmanager
def open_cluster(
    addresses: Sequence[str | Sequence[str]], timeout_s: float, security: ClientConfig | None = None
) -> Iterator[PSClient]:
    """A ``PSClient`` of ``addresses`` (its ``admin`` for the cluster's tables, stats and
    checkpoints) whose errors become ``AdminError`` with a hint; TLS and token from
    ``security``.

    ``ps-admin`` waits for no shard: an unreachable one fails the command at once (one
    attempt per call), instead of the training client's retries.
    """
    config = dataclasses.replace(security or ClientConfig(), deadline_s=timeout_s, max_attempts=1, tune_malloc=False)
    wait_s = min(timeout_s, REACH_S)
    _wait_reachable(addresses, config, wait_s)
    try:
        with PSClient(addresses, config) as client:
            yield client
    except PSError as exc:
        if isinstance(exc, ShardUnavailableError) and not exc.hint:
            raise AdminError(
                f"{exc}: cannot reach the shard: is it running, and is the address right? (--timeout-s sets how "
                "long to wait)",
                code=exc.code,
            ) from None
        if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise AdminError(f"{exc}: raise --timeout-s, or check the shard's log", code=exc.code) from None
        raise AdminError(str(exc), code=exc.code) from None


REACH_S = 10.0
"""How long a command waits for a shard that does not answer yet (one starting), at most."""


def _wait_reachable(addresses: Sequence[str | Sequence[str]], config: ClientConfig, wait_s: float) -> None:
    """Ask each address for its cluster map, again with backoff while it does not answer, for
    up to ``wait_s``; ``AdminError`` naming the first that never answers. A shard that
    answers with a refusal (a token, TLS) is reached: the command itself says what is wrong."""
    deadline = time.monotonic() + wait_s
    with ShardByAddress(dataclasses.replace(config, deadline_s=1.0)) as shards:
        for entry in (a for shard in addresses for a in ([shard] if isinstance(shard, str) else shard)):
            if entry.startswith("dns:"):
                continue  # a name of several replicas: the client resolves it
            backoff = Backoff(0.1, 1.0)
            while True:
                try:
                    shards.get_map(entry, timeout_s=max(0.1, min(1.0, deadline - time.monotonic())))
                    break
                except ShardUnavailableError as exc:
                    if exc.hint:  # it answers, in another language (TLS): waiting changes nothing
                        raise AdminError(str(exc), code=exc.code) from None
                    if time.monotonic() >= deadline:
                        raise AdminError(
                            f"{exc}: cannot reach the shard: is it running, and is the address right? (waited "
                            f"{wait_s:g} s for it; --timeout-s sets how long)",
                            code=exc.code,
                        ) from None
                    time.sleep(min(backoff.next_s(), max(0.0, deadline - time.monotonic())))
                except PSError:
                    break


def _check_order(client: PSClient) -> list[dict[str, Any]]:
    """Every shard's Stats; ``AdminError`` unless address ``i`` is shard ``i`` of ``n``."""
    n = client.num_shards
    stats = client.admin.stats()
    problems = []
    shard_of = [i for i, replicas in enumerate(client.replicas) for _ in replicas]
    for i, s in zip(shard_of, stats, strict=True):
        if s["num_shards"] != n:
            problems.append(
                f"{s['address']} is shard {s['shard']} of {s['num_shards']} shards, but --addresses "
                f"lists {n}: list every shard's address, in shard order"
            )
        elif s["shard"] != i:
            problems.append(
                f"{s['address']} is shard {s['shard']}, but it is listed for shard #{i} in --addresses: list the "
                "addresses in shard order (shard 0 first)"
            )
    if problems:
        raise AdminError("\n".join(problems))
    return stats


def _merge_tables(per_shard: Sequence[Sequence[dict[str, Any]]], where: Sequence[str]) -> list[dict[str, Any]]:
    """The union of the shards' table lists (manifest JSON), sorted by name; ``AdminError``
    if two shards hold a table of one name with different specs."""
    merged: dict[str, dict[str, Any]] = {}
    owner: dict[str, str] = {}
    for tables, source in zip(per_shard, where, strict=True):
        for t in tables:
            name = str(t.get("name", ""))
            if name in merged and merged[name] != t:
                raise AdminError(
                    f"table {name!r} has different specs on {owner[name]} and {source}: "
                    f"{json.dumps(merged[name], sort_keys=True)} != {json.dumps(t, sort_keys=True)}"
                )
            merged.setdefault(name, t)
            owner.setdefault(name, source)
    return [merged[n] for n in sorted(merged)]


def checkpoint_cluster(
    addresses: Sequence[str | Sequence[str]],
    out: str | Path | None = None,
    timeout_s: float = 600.0,
    security: ClientConfig | None = None,
) -> dict[str, Any]:
    """Checkpoint every shard of the cluster at ``addresses`` (shard order) as one checkpoint.

    ``out`` is the checkpoint's name (``AdminClient.checkpoint``): a directory each shard
    creates under its own ``--checkpoint-root`` (relative: resolved there, never against
    this process's working directory; absolute: must lie under every shard's root), in
    which shard ``i`` writes its part ``shard-{i:05d}-of-{n:05d}``. None: the next version
    number. Blocks until every shard is done. When every part lies in one directory this
    process sees (shards sharing a root), the cluster manifest is written there, last and
    atomically (what ``reshard`` reads). Returns the manifest, with ``name`` (what
    ``serve-from`` takes), ``parts`` (each shard's directory) and ``manifest_path``
    (None when the parts lie apart). Row counts are as the shards report them (exact in
    a shard that has not restarted; RocksDB's estimate for rows spilled before a
    restart): ``rows_estimated`` (per table) and ``shard_rows_estimated`` (per shard and
    table) say which. Raises ``AdminError`` (naming the address) when a shard is
    unreachable, out of order or fails.
    """
    name = None if out is None else str(out)
    n = len(addresses)
    with open_cluster(addresses, timeout_s, security) as client:
        _check_order(client)
        where = client.addresses
        try:
            replies = client.admin.checkpoint(name)
        except PSError as exc:
            hint = ""
            if "checkpoint root" in str(exc) and name is not None and Path(name).is_absolute():
                hint = (
                    f"\nan absolute --out must lie under every shard's --checkpoint-root; shards with roots of their "
                    f"own (the default: <data-dir>/checkpoints) need a relative --out such as {Path(name).name}, "
                    "which each shard resolves under its own root"
                )
            written = exc.written if isinstance(exc, CheckpointError) else ()
            left = (
                f"\nthe parts shards {', '.join(map(str, written))} wrote under "
                f"{repr(name) if name else 'the new version number'} make an incomplete checkpoint: remove them, "
                "or checkpoint again under a new name"
                if written
                else ""
            )
            raise AdminError(f"{exc}{hint}{left}", code=exc.code) from None
    checkpoint_name = str(replies[0]["name"])
    parts = [str(r["path"]) for r in replies]
    manifests = [r["manifest"] for r in replies]
    created_unix_s, created = now_stamp()
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "kind": "cluster",
        "num_shards": n,
        "shards": [shard_dir_name(i, n) for i in range(n)],
        "addresses": list(addresses),
        "created_unix_s": created_unix_s,
        "created": created,
        "tables": [],
        "rows": {},
        "rows_estimated": {},
        "shard_rows": [m.get("rows") or {} for m in manifests],
        "shard_rows_estimated": [m.get("rows_estimated") or {} for m in manifests],
        "push_ledgers": "kept",
    }
    for m in manifests:
        estimated = m.get("rows_estimated") or {}
        for table, count in (m.get("rows") or {}).items():
            manifest["rows"][table] = manifest["rows"].get(table, 0) + int(count)
            about = manifest["rows_estimated"].get(table, False) or bool(estimated.get(table, False))
            manifest["rows_estimated"][table] = about
    manifest["name"] = checkpoint_name
    info: dict[str, Any] = {"parts": parts, "manifest_path": None}
    try:
        manifest["tables"] = _merge_tables([m.get("tables", []) for m in manifests], where)
    except AdminError as exc:
        raise AdminError(
            f"{exc}\ncheckpoint {checkpoint_name} was left without manifest.json: fix the table, then checkpoint again"
        ) from None
    together = {str(Path(p).parent) for p in parts}
    if len(together) == 1 and all(Path(p).is_dir() for p in parts):
        root = Path(together.pop())
        write_manifest(root, manifest)
        info["manifest_path"] = str(root / "manifest.json")
    log.info("cluster checkpoint written name=%s shards=%d", checkpoint_name, n)
    return manifest | info


def list_checkpoints(roots: Sequence[Path]) -> list[dict[str, Any]]:
    """The checkpoints under ``roots`` (checkpoint roots this process sees), by name: for
    each, the parts found (``shard``, ``num_shards``, ``path``, ``created``, ``rows``,
    ``rows_estimated``: whether some table's count is RocksDB's estimate) and the cluster
    manifest's path if there is one. A part is a directory with ``db/`` and
    ``manifest.json``: ``NAME/shard-IIIII-of-NNNNN``, or ``NAME`` itself (older checkpoints).
    Raises ``AdminError`` for a root that is not a directory."""
    found: dict[str, dict[str, Any]] = {}
    for root in roots:
        if not root.is_dir():
            raise AdminError(f"--root {root}: not a directory (a shard's --checkpoint-root, e.g. DATA_DIR/checkpoints)")
        for entry in sorted(root.iterdir()):
            if not entry.is_dir():
                continue
            dirs = [entry] if (entry / "db").is_dir() else sorted(entry.glob("shard-*-of-*"))
            parts = []
            for d in dirs:
                try:
                    m: dict[str, Any] = dict(read_manifest(d))
                except (DataDirError, StorageFailed, OSError, ValueError):
                    continue
                rows = sum(int(v) for v in (m.get("rows") or {}).values())
                estimated = any(bool(v) for v in (m.get("rows_estimated") or {}).values())
                parts.append(
                    {
                        "shard": m.get("shard"),
                        "num_shards": m.get("num_shards"),
                        "path": str(d),
                        "created": m.get("created"),
                        "rows": rows,
                        "rows_estimated": estimated,
                    }
                )
            if not parts:
                continue
            item = found.setdefault(entry.name, {"name": entry.name, "parts": [], "manifests": []})
            item["parts"] += parts
            if (entry / "manifest.json").is_file() and not (entry / "db").is_dir():
                item["manifests"].append(str(entry / "manifest.json"))
    out = []
    for item in found.values():
        item["parts"].sort(key=lambda p: (p["shard"] is None, p["shard"] or 0))
        n = {p["num_shards"] for p in item["parts"]}
        shards = {p["shard"] for p in item["parts"]}
        item["complete"] = len(n) == 1 and shards == set(range(n.pop()))
        out.append(item)
    return out


def cluster_stats(
    addresses: Sequence[str | Sequence[str]], timeout_s: float = 10.0, security: ClientConfig | None = None
) -> list[dict[str, Any]]:
    """The Stats of every shard (``AdminClient.stats()``), in address order; ``AdminError`` naming unreachable ones."""
    with open_cluster(addresses, timeout_s, security) as client:
        return client.admin.stats()


def cluster_tables(
    addresses: Sequence[str | Sequence[str]], timeout_s: float = 10.0, security: ClientConfig | None = None
) -> list[dict[str, Any]]:
    """Every table of the cluster, as shard 0 reports it."""
    with open_cluster(addresses, timeout_s, security) as client:
        return [dataclasses.asdict(t) for _, t in sorted(client.admin.tables().items())]


def create_table(
    addresses: Sequence[str | Sequence[str]],
    name: str,
    dim: int,
    options: dict[str, Any],
    timeout_s: float = 30.0,
    security: ClientConfig | None = None,
) -> dict[str, Any]:
    """Create ``name`` on every shard (``PSClient.create_table``); the table as created."""
    with open_cluster(addresses, timeout_s, security) as client:
        try:
            return dataclasses.asdict(client.create_table(name, dim, **options))
        except (TypeError, ValueError) as exc:
            raise AdminError(str(exc)) from None


def cluster_health(
    addresses: Sequence[str | Sequence[str]], timeout_s: float = 5.0, security: ClientConfig | None = None
) -> list[dict[str, Any]]:
    """The gRPC health status of every address and health service (no token needed).

    Each row: ``address``, ``services`` (service -> status, or the error of the call),
    ``serving`` and ``hint``: what to do when the call failed because one side speaks
    TLS and the other does not (``client.errors.tls_hint``, as every other command
    says it), else "".
    """
    out: list[dict[str, Any]] = []
    entries = [a for shard in addresses for a in ([shard] if isinstance(shard, str) else shard)]
    flat = []
    for entry in entries:  # a dns: entry: every replica its name resolves to
        try:
            flat += addresses_of(entry)
        except OSError as exc:
            out.append(
                {"address": entry, "services": {"(server)": f"does not resolve: {exc}"}, "hint": "", "serving": False}
            )
    for address in flat:
        row: dict[str, Any] = {"address": address, "services": {}, "hint": ""}
        try:
            caller = _caller(security)
            credentials = caller.credentials
            with open_channel(address, credentials, []) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in SHARD_HEALTH:
                    try:
                        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    except grpc.RpcError as exc:
                        if exc.code() == grpc.StatusCode.NOT_FOUND:
                            continue  # not a service of this kind of shard
                        row["services"][service or "(server)"] = f"{exc.code().name}: {exc.details()}"
                        row["hint"] = tls_hint(
                            exc.code(), str(exc.details()), address, credentials is not None, caller.client_certificate
                        )
                        break  # unreachable: the other services would only say so again
                    row["services"][service or "(server)"] = status
        except ValueError as exc:  # a TLS file that cannot be used
            raise AdminError(str(exc)) from None
        row["serving"] = bool(row["services"]) and all(v == "SERVING" for v in row["services"].values())
        out.append(row)
    return out


def _caller(security: ClientConfig | None) -> CallerSecurity:
    return (security or ClientConfig()).caller_security()


class GrpcShards:
    """``deploy.scale.ShardCalls`` over ``AdminClient``'s calls to one shard by address
    (TLS and token from ``security``), each limited to ``timeout_s``: a shard asking to be
    asked again (UNAVAILABLE, no TLS mismatch) raises ``RetryLater``, any other failure
    ``AdminError`` naming the address."""

    def __init__(self, timeout_s: float, security: ClientConfig | None = None) -> None:
        self._shards = ShardByAddress(dataclasses.replace(security or ClientConfig(), deadline_s=timeout_s))

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except ShardUnavailableError as exc:
            if exc.hint:
                raise AdminError(str(exc), code=exc.code) from None
            raise RetryLater(str(exc)) from None
        except PSError as exc:
            raise AdminError(str(exc), code=exc.code) from None

    def get_map(self, address: str) -> pb.GetMapResponse:
        return self._call(lambda: self._shards.get_map(address))

    def reshard(self, address: str, request: pb.ReshardRequest) -> pb.ReshardStatus:
        return self._call(lambda: self._shards.reshard(address, request))

    def close(self) -> None:
        self._shards.close()


def scale_cluster(
    addresses: Sequence[str],
    to: Sequence[str],
    *,
    abort: bool = False,
    timeout_s: float = 3600.0,
    call_timeout_s: float = 30.0,
    serving: tuple[Sequence[Sequence[str]], Sequence[Sequence[str]]] | None = None,
    say: Callable[[str], None] = log.info,
    max_rows_per_s: float = 0.0,
    security: ClientConfig | None = None,
) -> ScaleReport:
    """``deploy.scale.scale`` of the running cluster at ``addresses`` to ``to`` (and of its
    ``serving`` shards, before and after), over gRPC, saying its progress through ``say``;
    ``AdminError`` (with what to do) on failure."""
    shards = GrpcShards(call_timeout_s, security)
    try:
        return scale(
            shards,
            addresses,
            to,
            say=say,
            abort=abort,
            timeout_s=timeout_s,
            serving=serving,
            max_rows_per_s=max_rows_per_s,
        )
    finally:
        shards.close()
