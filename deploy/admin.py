"""``ps-admin``: operations on a whole cluster, or on its checkpoints.

It talks to shards through ``client.PSClient`` (one channel setup and one error tree for
every tool) and reads checkpoints offline with ``ps.storage``.

* ``ps-admin checkpoint [--addresses A0,A1,...] [--out NAME]``: every shard writes its
  part of the checkpoint NAME to ``NAME/shard-{i:05d}-of-{n:05d}`` under its own
  ``--checkpoint-root`` (default ``<data-dir>/checkpoints``; the Checkpoint RPC, all
  shards in parallel). A relative NAME is resolved under each shard's root, never
  against ps-admin's working directory; an absolute one must lie under every shard's
  root (shards sharing one root). Without ``--out``, NAME is the next version number
  (``000001``, ...: shard 0 picks it, the others follow), as ``PSClient.checkpoint()``
  names them. It prints NAME, which ``serve-from --checkpoint`` takes. When every part
  lies in one directory ps-admin sees, ``NAME/manifest.json`` (the cluster manifest) is
  written there, last and atomically: what ``reshard`` reads. Each shard checkpoints at
  its own instant: for one cut across the cluster, pause training first.
* ``ps-admin list --root ROOT [--root ROOT ...]``: offline, the checkpoints under
  checkpoint roots this machine sees, with the shard parts found.
* ``ps-admin reshard --from CKPT --to-shards M --out DIR``: offline, reads the cluster
  checkpoint ``CKPT`` (n shards) and writes a cluster checkpoint of ``M`` shards where
  every row, its optimizer state, ``last_access`` and ``frequency`` sit bit for bit on
  the shard ``protos.keys.shard_of(key, M)`` assigns. Push ledgers (exactly-once
  records) are not carried over: a resharded cluster is a new cluster and its clients
  start fresh.
* ``ps-admin stats --addresses ...``: one line per shard and table from the Stats RPC.
* ``ps-admin tables``, ``create-table --name N --dim D [optimizer=adagrad lr=0.05 ...]``,
  ``health`` (every health service of every replica; exit 1 unless all serve),
  ``serve-from --checkpoint NAME`` (pin serving shards to their part of a checkpoint:
  roll back) and ``unpin`` (the same as ``serve-from --unpin``: back to their source).

``--addresses`` defaults to ``$PS_ADDRESSES`` (``$SERVING_ADDRESSES`` for ``serve-from``
and ``unpin``): ``,`` between shards in shard order, ``+`` between a shard's replicas.

Every command prints text, or JSON with ``--json``. ``--tls-ca``/``--tls-cert``/
``--tls-key``/``--token-file`` (default: the ``PS_CLIENT_*`` environment) reach secured
shards; creating tables needs a write token, checkpoints and pins an admin token.

Start shard ``j`` of a checkpoint with
``ps-server --shard j --num-shards M --data-dir NEW --restore-from DIR/shard-...``.

Exit codes: 0 done, 1 failed (the message on stderr says what to do), 2 bad arguments.

Cluster manifest (``DIR/manifest.json``)::

    {"format": 1, "kind": "cluster", "num_shards": n, "shards": ["shard-00000-of-0000n", ...],
     "created_unix_s": ..., "created": "...Z", "tables": [TableSpec as JSON, ...],
     "rows": {"table": rows}, "push_ledgers": "kept" | "dropped", ...}

Example:
    >>> parse_addresses("127.0.0.1:5000, 127.0.0.1:5001+127.0.0.1:5002")
    [['127.0.0.1:5000'], ['127.0.0.1:5001', '127.0.0.1:5002']]
    >>> shard_dir_name(2, 3)
    'shard-00002-of-00003'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import ClientConfig, PSClient, PSError, ShardUnavailableError
from client import parse_addresses as client_parse_addresses
from deploy.reshard import SCAN_CHUNK_ROWS, AdminError, now_stamp, read_cluster_manifest, reshard, shard_dir_name
from protos.tls import TLSError, channel_credentials, open_channel
from ps.storage import FORMAT_VERSION, DataDirError, StorageFailed, read_manifest, write_manifest

__all__ = [
    "AdminError",
    "checkpoint_cluster",
    "cluster_stats",
    "main",
    "parse_addresses",
    "read_cluster_manifest",
    "reshard",
    "shard_dir_name",
]

log = logging.getLogger(__name__)


def parse_addresses(text: str) -> list[list[str]]:
    """``HOST:PORT+HOST:PORT,HOST:PORT`` as replica lists, shard 0 first (``client.parse_addresses``).
    ``ValueError`` names a bad entry."""
    return client_parse_addresses(text)


# -- talking to shards -------------------------------------------------------------------


CLIENT_OPTIONS: dict[str, Any] = {}
"""TLS and token settings of every client ``ps-admin`` opens (``main`` fills it from
``--tls-ca``/``--tls-cert``/``--tls-key``/``--token-file``; unset ones come from the
``PS_CLIENT_*`` environment, see ``ClientConfig``)."""

HEALTH_SERVICES = (
    "",
    "ps.v1.ParameterServer",
    "ps.v1.ParameterServer.Writes",
    "ps.v1.ParameterServer.Background",
    "ps.v1.ParameterServer.Follow",
)


@contextlib.contextmanager
def _cluster(addresses: Sequence[str | Sequence[str]], timeout_s: float) -> Iterator[PSClient]:
    """A ``PSClient`` of ``addresses`` whose errors become ``AdminError`` with a hint.

    ``ps-admin`` waits for no shard: an unreachable one fails the command at once (one
    attempt per call), instead of the training client's retries.
    """
    config = ClientConfig(deadline_s=timeout_s, max_attempts=1, tune_malloc=False, **CLIENT_OPTIONS)
    try:
        with PSClient(addresses, config) as client:
            yield client
    except PSError as exc:
        if isinstance(exc, ShardUnavailableError) and not exc.hint:
            raise AdminError(f"{exc}: cannot reach the shard: is it running, and is the address right?") from None
        if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise AdminError(f"{exc}: raise --timeout-s, or check the shard's log") from None
        raise AdminError(str(exc)) from None


def _check_order(client: PSClient) -> list[dict[str, Any]]:
    """Every shard's Stats; ``AdminError`` unless address ``i`` is shard ``i`` of ``n``."""
    n = client.num_shards
    stats = client.stats()
    problems = []
    shard_of = [i for i, replicas in enumerate(client.replicas) for _ in replicas]
    for i, s in zip(shard_of, stats, strict=True):
        if s["num_shards"] != n:
            problems.append(
                f"{s['address']} is shard {s['shard']} of a {s['num_shards']}-shard cluster, but --addresses "
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


# -- checkpoint --------------------------------------------------------------------------


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
    addresses: Sequence[str | Sequence[str]], out: str | Path | None = None, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Checkpoint every shard of the cluster at ``addresses`` (shard order) as one checkpoint.

    ``out`` is the checkpoint's name (``PSClient.checkpoint``): a directory each shard
    creates under its own ``--checkpoint-root`` (relative: resolved there, never against
    this process's working directory; absolute: must lie under every shard's root), in
    which shard ``i`` writes its part ``shard-{i:05d}-of-{n:05d}``. None: the next version
    number. Blocks until every shard is done. When every part lies in one directory this
    process sees (shards sharing a root), the cluster manifest is written there, last and
    atomically (what ``reshard`` reads). Returns the manifest, with ``name`` (what
    ``serve-from`` takes), ``parts`` (each shard's directory) and ``manifest_path``
    (None when the parts lie apart). Row counts are as the shards report them (exact in
    a shard that has not restarted; RocksDB's estimate for rows spilled before a
    restart). Raises ``AdminError`` (naming the address) when a shard is unreachable,
    out of order or fails.
    """
    name = None if out is None else str(out)
    n = len(addresses)
    with _cluster(addresses, timeout_s) as client:
        _check_order(client)
        where = client.addresses
        try:
            replies = client.checkpoint(name)
        except PSError as exc:
            hint = ""
            if "checkpoint root" in str(exc) and name is not None and Path(name).is_absolute():
                hint = (
                    f"\nan absolute --out must lie under every shard's --checkpoint-root; shards with roots of their "
                    f"own (the default: <data-dir>/checkpoints) need a relative --out such as {Path(name).name}, "
                    "which each shard resolves under its own root"
                )
            left = (
                f"\nparts other shards wrote under {repr(name) if name else 'the new version number'} make an "
                "incomplete checkpoint: remove them, or checkpoint again under a new name"
                if n > 1
                else ""
            )
            raise AdminError(f"{exc}{hint}{left}") from None
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
        "shard_rows": [m.get("rows") or {} for m in manifests],
        "push_ledgers": "kept",
    }
    for m in manifests:
        for table, count in (m.get("rows") or {}).items():
            manifest["rows"][table] = manifest["rows"].get(table, 0) + int(count)
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
    each, the parts found (``shard``, ``num_shards``, ``path``, ``created``, ``rows``) and
    the cluster manifest's path if there is one. A part is a directory with ``db/`` and
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
                parts.append(
                    {
                        "shard": m.get("shard"),
                        "num_shards": m.get("num_shards"),
                        "path": str(d),
                        "created": m.get("created"),
                        "rows": rows,
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


def _format_checkpoints(found: Sequence[dict[str, Any]]) -> str:
    if not found:
        return "no checkpoints"
    lines = []
    for c in found:
        parts = c["parts"]
        n = parts[0]["num_shards"]
        shards = ",".join(str(p["shard"]) for p in parts)
        state = "all shards" if c["complete"] else "INCOMPLETE"
        created = max(str(p["created"]) for p in parts)
        rows = sum(p["rows"] for p in parts)
        lines.append(f"{c['name']}: shards {shards} of {n} ({state}), created {created}, {rows} rows")
    return "\n".join(lines)


# -- stats -------------------------------------------------------------------------------


def cluster_stats(addresses: Sequence[str | Sequence[str]], timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The Stats of every shard (``PSClient.stats()``), in address order; ``AdminError`` naming unreachable ones."""
    with _cluster(addresses, timeout_s) as client:
        return client.stats()


def _format_stats(stats: Sequence[dict[str, Any]]) -> str:
    header = ("shard", "table", "rows", "resident", "spilled", "hit_rate", "bytes/row", "durability", "writable")
    lines: list[tuple[str, ...]] = [header]
    estimated = False
    for s in stats:
        shard = f"{s['shard']}/{s['num_shards']}"
        f = s["follow"]
        if s["mode"] == "serve":  # where the rows come from, and how fresh they are
            lag = f" lag={f['lag_versions']}v/{f['lag_s']:.2f}s" + ("" if f["connected"] else f" DOWN: {f['error']}")
            where = {"follow": f"following {f['leader']}{lag}", "checkpoint": f"pinned to {f['checkpoint']}"}
            lines.append(
                (
                    shard,
                    f"[{s['address']} serve, version {s['version']}: {where.get(f['source'], 'data dir')}]",
                    *[""] * 7,
                )
            )
        durability = s["durability"] or "ram-only"
        if s["mode"] == "serve":
            writable = "read-only (serve)" + (f"; storage NO: {s['storage_error']}" if s["storage_error"] else "")
        else:
            writable = "yes" if s["writable"] else f"NO: {s['storage_error']}"
        if not s["tables"]:
            lines.append((shard, "-", "0", "0", "0", "-", "-", durability, writable))
        for t in s["tables"]:
            about = "~" if t["rows_estimated"] else ""  # RocksDB's estimate: see the note below
            estimated = estimated or bool(about)
            lines.append(
                (
                    shard,
                    t["name"],
                    f"{about}{t['rows']}",
                    str(t["resident_rows"]),
                    f"{about}{t['spilled_rows']}",
                    f"{t['ram_hit_rate']:.3f}",
                    f"{t['bytes_per_resident_row']:.0f}",
                    durability,
                    writable,
                )
            )
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    table = "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines)
    if estimated:
        table += (
            "\n~ about: the table was reopened from disk, and its rows there are RocksDB's estimate "
            "(shards holding the same keys may differ)"
        )
    return table


def cluster_tables(addresses: Sequence[str | Sequence[str]], timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Every table of the cluster, as shard 0 reports it."""
    with _cluster(addresses, timeout_s) as client:
        return [dataclasses.asdict(t) for _, t in sorted(client.tables().items())]


def create_table(
    addresses: Sequence[str | Sequence[str]], name: str, dim: int, options: dict[str, Any], timeout_s: float = 30.0
) -> dict[str, Any]:
    """Create ``name`` on every shard (``PSClient.create_table``); the table as created."""
    with _cluster(addresses, timeout_s) as client:
        try:
            return dataclasses.asdict(client.create_table(name, dim, **options))
        except (TypeError, ValueError) as exc:
            raise AdminError(str(exc)) from None


def cluster_health(addresses: Sequence[str | Sequence[str]], timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The gRPC health status of every address and health service (no token needed)."""
    out = []
    flat = [a for shard in addresses for a in ([shard] if isinstance(shard, str) else shard)]
    for address in flat:
        row: dict[str, Any] = {"address": address, "services": {}}
        try:
            with open_channel(address, _health_credentials(), []) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in HEALTH_SERVICES:
                    try:
                        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    except grpc.RpcError as exc:
                        if exc.code() == grpc.StatusCode.NOT_FOUND:
                            continue  # not a service of this kind of shard
                        row["services"][service or "(server)"] = f"{exc.code().name}: {exc.details()}"
                        break  # unreachable: the other services would only say so again
                    row["services"][service or "(server)"] = status
        except TLSError as exc:
            raise AdminError(str(exc)) from None
        row["serving"] = bool(row["services"]) and all(v == "SERVING" for v in row["services"].values())
        out.append(row)
    return out


def _health_credentials() -> grpc.ChannelCredentials | None:
    config = ClientConfig(**CLIENT_OPTIONS)
    return channel_credentials(config.tls_ca, config.tls_cert, config.tls_key) if config.tls else None


def _format_health(rows: Sequence[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        states = ", ".join(f"{k}={v}" for k, v in r["services"].items())
        lines.append(f"{r['address']}: {'SERVING' if r['serving'] else 'NOT SERVING'} ({states})")
    return "\n".join(lines)


def _format_tables(tables: Sequence[dict[str, Any]]) -> str:
    if not tables:
        return "no tables"
    return "\n".join(
        f"{t['name']}: dim {t['dim']}, optimizer {t['optimizer']}, initializer {t['initializer']}, seed {t['seed']}"
        for t in tables
    )


def _table_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. lr=0.05")
    if key in ("optimizer", "initializer", "serving_default"):
        return key, value
    try:
        return key, int(value) if key == "seed" else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {key} takes a number") from None


# -- command line ------------------------------------------------------------------------


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value}: must be a finite number > 0")
    return value


def _addresses(text: str) -> list[list[str]]:
    try:
        return parse_addresses(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``ps-admin`` argument parser (every subcommand; ``ps-admin --help`` lists them)."""
    parser = argparse.ArgumentParser(
        prog="ps-admin",
        description="Operate on a parameter-server cluster and its checkpoints; each COMMAND is listed below "
        "(ps-admin COMMAND --help for its flags). --addresses defaults to $PS_ADDRESSES ($SERVING_ADDRESSES for "
        "serve-from). Exit codes: 0 done, 1 failed (stderr says what to do), 2 bad arguments.",
    )
    parser.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    sec = parser.add_argument_group("security (defaults: the PS_CLIENT_* environment variables)")
    sec.add_argument("--tls-ca", help="PEM CA of the shards' certificates: connect with TLS")
    sec.add_argument("--tls-cert", help="PEM client certificate, for shards that require mutual TLS")
    sec.add_argument("--tls-key", help="PEM key of --tls-cert")
    sec.add_argument(
        "--token-file", help="file holding the bearer token (write for create-table; admin for checkpoint, serve-from)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # --json may also come after the command; the subcommand's copy leaves an earlier one alone.
    json_after = argparse.ArgumentParser(add_help=False)
    json_after.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    sub_add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub_add(name, parents=[json_after], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    addresses_help = "HOST:PORT of every shard, ',' between shards, shard 0 first, '+' between the replicas of one"

    def addresses(p: argparse.ArgumentParser, env: str = "PS_ADDRESSES") -> None:
        default = os.environ.get(env) or None  # argparse parses a string default with type=
        p.add_argument(
            "--addresses",
            required=default is None,
            default=default,
            type=_addresses,
            help=f"{addresses_help} (default: ${env}{', unset' if default is None else ''})",
        )

    ck = sub.add_parser(
        "checkpoint",
        help="checkpoint every shard of a running cluster as one named checkpoint",
        description="Every shard writes its part of the checkpoint NAME to NAME/shard-IIIII-of-NNNNN under its "
        "own --checkpoint-root (default <data-dir>/checkpoints), in parallel (pushes wait while a shard's part "
        "is taken). It prints NAME: serve-from --checkpoint NAME serves it. When every part lies in one directory "
        "ps-admin sees (shards sharing a --checkpoint-root), NAME/manifest.json is written there last "
        "(reshard reads it).",
    )
    addresses(ck)
    ck.add_argument(
        "--out",
        "--name",
        dest="out",
        default=None,
        help="the checkpoint's name: a relative NAME is resolved under each shard's --checkpoint-root (not "
        "against this directory); an absolute path must lie under every shard's root. Default: the next "
        "version number (000001, 000002, ...)",
    )
    ck.add_argument("--timeout-s", type=_positive_seconds, default=600.0, help="per-shard limit (default 600)")

    ls = sub.add_parser(
        "list",
        help="list the checkpoints under checkpoint roots this machine sees (offline)",
        description="List the checkpoints under each ROOT (a shard's --checkpoint-root, e.g. "
        "<data-dir>/checkpoints; give one --root per shard when each has its own): name, the shard parts found, "
        "whether the cluster manifest is there, when, and rows.",
    )
    ls.add_argument("--root", action="append", required=True, type=Path, help="a checkpoint root; repeatable")

    rs = sub.add_parser(
        "reshard",
        help="rewrite a cluster checkpoint for another number of shards (offline)",
        description="Read the cluster checkpoint FROM and write one of TO_SHARDS shards into OUT: every row, "
        "with its optimizer state, last access and frequency, goes bit for bit to the shard that jump "
        "hash assigns. Push ledgers (exactly-once records) are NOT carried over: the resharded cluster "
        "is a new cluster and its clients start fresh. Start shard J with: ps-server --shard J "
        "--num-shards TO_SHARDS --data-dir NEW --restore-from OUT/shard-JJJJJ-of-MMMMM",
    )
    rs.add_argument("--from", dest="src", required=True, type=Path, help="cluster checkpoint to read")
    rs.add_argument("--to-shards", required=True, type=_at_least_one, help="number of shards to write (>= 1)")
    rs.add_argument("--out", required=True, type=Path, help="directory to create for the new checkpoint")
    rs.add_argument("--chunk-rows", type=_at_least_one, default=SCAN_CHUNK_ROWS, help="rows read per step")

    st = sub.add_parser("stats", help="print rows, RAM tier and durability of every shard and table")
    addresses(st)
    st.add_argument("--timeout-s", type=_positive_seconds, default=10.0, help="per-shard limit (default 10)")

    sf = sub.add_parser(
        "serve-from",
        help="pin serving shards to a checkpoint version (roll back), or back to their own source",
        description="Serving shards (ps-server --mode serve) switch to serving their part of the checkpoint "
        "CHECKPOINT (the NAME ps-admin checkpoint printed, a version number such as 3, or a path under each "
        "shard's --checkpoint-root, which for a serving shard is its training shard's root) read-only; a "
        "follower keeps its place meanwhile. --unpin switches them back: a follower catches up with its "
        "training shard.",
    )
    addresses(sf, "SERVING_ADDRESSES")
    which = sf.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="checkpoint name, version number or path to serve")
    which.add_argument("--unpin", action="store_true", help="serve the shards' own source again")
    sf.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="per-shard limit (default 30)")

    up = sub.add_parser(
        "unpin",
        help="switch pinned serving shards back to their own source (serve-from --unpin)",
        description="Serving shards pinned by serve-from serve their own source again: a follower catches up "
        "with its training shard.",
    )
    addresses(up, "SERVING_ADDRESSES")
    up.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="per-shard limit (default 30)")

    tb = sub.add_parser("tables", help="list the cluster's tables")
    addresses(tb)
    tb.add_argument("--timeout-s", type=_positive_seconds, default=10.0, help="per-shard limit (default 10)")

    ct = sub.add_parser(
        "create-table",
        help="create a table on every shard",
        description="Create NAME on every shard (nothing changes if an identical table exists; a different "
        "one with that name is an error naming each difference). Options are NAME=VALUE: optimizer "
        "(sgd, adagrad, adam, ftrl), initializer (uniform, normal, zeros, constant), seed, serving_default "
        "(zeros, initial) and numbers such as lr=0.05, ttl_seconds=86400, admit_after=2.",
    )
    addresses(ct)
    ct.add_argument("--name", required=True, help="table name")
    ct.add_argument("--dim", required=True, type=_at_least_one, help="row width")
    ct.add_argument("option", nargs="*", type=_table_option, help="NAME=VALUE settings of the table")
    ct.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="per-shard limit (default 30)")

    hc = sub.add_parser("health", help="gRPC health of every shard and replica (exit 1 unless all serve)")
    addresses(hc)
    hc.add_argument("--timeout-s", type=_positive_seconds, default=5.0, help="per-call limit (default 5)")
    return parser


def _print_rows(manifest: dict[str, Any]) -> None:
    per_shard = manifest.get("shard_rows") or []
    for table, total in sorted((manifest.get("rows") or {}).items()):
        parts = ", ".join(str(r.get(table, 0)) for r in per_shard)
        print(f"  table {table}: {total} rows (by shard: {parts})")
    if not manifest.get("rows"):
        print("  no tables")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ps-admin`` console script; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level, format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s"
    )
    CLIENT_OPTIONS.clear()
    for flag in ("tls_ca", "tls_cert", "tls_key", "token_file"):
        if getattr(args, flag) is not None:
            CLIENT_OPTIONS[flag] = getattr(args, flag)
    try:
        if args.command == "checkpoint":
            manifest = checkpoint_cluster(args.addresses, args.out, args.timeout_s)
            if args.json:
                print(json.dumps(manifest, indent=2, sort_keys=True))
                return 0
            print(f"checkpoint {manifest['name']} of {manifest['num_shards']} shards written:")
            for i, part in enumerate(manifest["parts"]):
                print(f"  shard {i}: {part}")
            print(
                f"  cluster manifest: {manifest['manifest_path']}"
                if manifest["manifest_path"]
                else "  no cluster manifest: the parts lie under different roots (reshard needs a shared root)"
            )
            _print_rows(manifest)
            print(f"serve it: ps-admin serve-from --addresses SERVING_SHARDS --checkpoint {manifest['name']}")
        elif args.command == "reshard":
            manifest = reshard(args.src, args.to_shards, args.out, args.chunk_rows)
            if args.json:
                print(json.dumps(manifest, indent=2, sort_keys=True))
                return 0
            print(
                f"resharded {args.src.absolute()} ({manifest['resharded_from']['num_shards']} shards) into "
                f"{args.out.absolute()} ({manifest['num_shards']} shards); push ledgers were not carried over"
            )
            _print_rows(manifest)
        elif args.command in ("serve-from", "unpin"):
            unpin = args.command == "unpin" or args.unpin
            with _cluster(args.addresses, args.timeout_s) as client:
                statuses = client.serve_from(None if unpin else args.checkpoint)
            if args.json:
                print(json.dumps(statuses, indent=2, sort_keys=True))
                return 0
            for st in statuses:
                print(f"{st['address']}: serving {st['checkpoint'] or st['source']}, version {st['applied_version']}")
        elif args.command == "list":
            found = list_checkpoints(args.root)
            print(json.dumps(found, indent=2, sort_keys=True) if args.json else _format_checkpoints(found))
        elif args.command == "tables":
            tables = cluster_tables(args.addresses, args.timeout_s)
            print(json.dumps(tables, indent=2, sort_keys=True) if args.json else _format_tables(tables))
        elif args.command == "create-table":
            table = create_table(args.addresses, args.name, args.dim, dict(args.option), args.timeout_s)
            print(json.dumps(table, indent=2, sort_keys=True) if args.json else _format_tables([table]))
        elif args.command == "health":
            rows = cluster_health(args.addresses, args.timeout_s)
            print(json.dumps(rows, indent=2, sort_keys=True) if args.json else _format_health(rows))
            return 0 if all(r["serving"] for r in rows) else 1
        else:
            stats = cluster_stats(args.addresses, args.timeout_s)
            print(json.dumps(stats, indent=2, sort_keys=True) if args.json else _format_stats(stats))
    except AdminError as exc:
        print(f"ps-admin {args.command}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad --tls-*/--token-file (unreadable file, a cert without its key)
        print(f"ps-admin {args.command}: {exc}", file=sys.stderr)
        return 2
    except (StorageFailed, DataDirError, OSError) as exc:
        print(f"ps-admin {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
