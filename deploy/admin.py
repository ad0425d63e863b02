"""``ps-admin``: operations on a whole cluster, or on its checkpoints.

It talks to shards through ``client.PSClient`` (one channel setup and one error tree for
every tool) and reads checkpoints offline with ``ps.storage``.

* ``ps-admin checkpoint --addresses A0,A1,... --out DIR``: every shard writes a
  consistent checkpoint of itself to ``DIR/shard-{i:05d}-of-{n:05d}`` (the Checkpoint
  RPC, all shards in parallel); then ``DIR/manifest.json`` (the cluster manifest) is
  written, last and atomically. A ``DIR`` without ``manifest.json`` is incomplete.
  Shards write ``DIR`` on their own filesystem, so it must be a path every shard and
  ``ps-admin`` see alike (one machine, or a shared filesystem), and it must lie under
  every shard's checkpoint root: start the shards with one ``--checkpoint-root ROOT``
  on that filesystem and pass an ``--out`` below ``ROOT`` (the default root,
  ``<data-dir>/checkpoints``, is a different directory on every shard). Each shard
  checkpoints at its own instant: for one cut across the cluster, pause training first.
* ``ps-admin reshard --from CKPT --to-shards M --out DIR``: offline, reads the cluster
  checkpoint ``CKPT`` (n shards) and writes a cluster checkpoint of ``M`` shards where
  every row, its optimizer state, ``last_access`` and ``frequency`` sit bit for bit on
  the shard ``protos.keys.shard_of(key, M)`` assigns. Push ledgers (exactly-once
  records) are not carried over: a resharded cluster is a new cluster and its clients
  start fresh.
* ``ps-admin stats --addresses ...``: one line per shard and table from the Stats RPC.
* ``ps-admin tables``, ``create-table --name N --dim D [optimizer=adagrad lr=0.05 ...]``,
  ``health`` (every health service of every replica; exit 1 unless all serve), and
  ``serve-from --checkpoint V | --unpin`` (pin serving shards, roll back).

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
    >>> parse_addresses("127.0.0.1:5000, 127.0.0.1:5001|127.0.0.1:5002")
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
from ps.storage import FORMAT_VERSION, DataDirError, StorageFailed, write_manifest

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
    """``HOST:PORT|HOST:PORT,HOST:PORT`` as replica lists, shard 0 first (``client.parse_addresses``).
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


def checkpoint_cluster(addresses: Sequence[str | Sequence[str]], out: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Checkpoint every shard of the cluster at ``addresses`` (shard order) into ``out``.

    Blocks until every shard is done, then writes ``out/manifest.json`` and returns it.
    ``out`` must not exist. Row counts are as the shards report them (exact in a shard
    that has not restarted; RocksDB's estimate for rows spilled before a restart).
    Raises ``AdminError`` (naming the address) when a shard is unreachable, out of
    order or fails; ``out`` is then left without a manifest.
    """
    out = Path(out).absolute()
    if out.exists():
        raise AdminError(f"--out {out} exists: choose a new directory (a checkpoint never overwrites one)")
    n = len(addresses)
    names = [shard_dir_name(i, n) for i in range(n)]
    with _cluster(addresses, timeout_s) as client:
        _check_order(client)
        where = client.addresses
        try:
            out.mkdir(parents=True)
        except OSError as exc:
            raise AdminError(f"cannot create --out {out}: {exc.strerror}") from None
        try:
            replies = client.checkpoint([str(out / name) for name in names])
        except PSError as exc:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if no shard wrote anything
            left = f"{out} is incomplete (no manifest.json): remove it, then retry" if out.exists() else ""
            if "checkpoint root" in str(exc):
                left = (
                    f"every shard must be started with a --checkpoint-root that contains --out {out} "
                    f"(e.g. --checkpoint-root {out.parent}), on a filesystem ps-admin sees too\n{left}"
                )
            raise AdminError(f"{exc}\n{left}".rstrip()) from None
    manifests = [r["manifest"] for r in replies]
    try:
        tables = _merge_tables([m.get("tables", []) for m in manifests], where)
    except AdminError as exc:
        raise AdminError(f"{exc}\n{out} was left without manifest.json: fix the table, then checkpoint again") from None
    rows: dict[str, int] = {}
    for m in manifests:
        for table, count in (m.get("rows") or {}).items():
            rows[table] = rows.get(table, 0) + int(count)
    created_unix_s, created = now_stamp()
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "kind": "cluster",
        "num_shards": n,
        "shards": names,
        "addresses": list(addresses),
        "created_unix_s": created_unix_s,
        "created": created,
        "tables": tables,
        "rows": rows,
        "shard_rows": [m.get("rows") or {} for m in manifests],
        "push_ledgers": "kept",
    }
    write_manifest(out, manifest)
    log.info("cluster checkpoint written path=%s shards=%d", out, n)
    return manifest


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
    """The ``ps-admin`` argument parser (subcommands checkpoint, reshard, stats)."""
    parser = argparse.ArgumentParser(
        prog="ps-admin",
        description="Operate on a parameter-server cluster: checkpoint it, reshard a checkpoint, show stats. "
        "Exit codes: 0 done, 1 failed (stderr says what to do), 2 bad arguments.",
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

    addresses_help = "HOST:PORT of every shard, comma-separated, shard 0 first"
    ck = sub.add_parser(
        "checkpoint",
        help="checkpoint every shard of a running cluster into one directory",
        description="Every shard checkpoints itself into OUT/shard-IIIII-of-NNNNN (in parallel; pushes wait "
        "while a shard's checkpoint is taken); then OUT/manifest.json is written. OUT must be a new "
        "path that the shards and ps-admin see alike (same machine or a shared filesystem), under every "
        "shard's --checkpoint-root. A directory without manifest.json is an incomplete checkpoint.",
    )
    ck.add_argument("--addresses", required=True, type=_addresses, help=addresses_help)
    ck.add_argument(
        "--out",
        required=True,
        type=Path,
        help="directory to create for the checkpoint, under the shards' --checkpoint-root",
    )
    ck.add_argument("--timeout-s", type=_positive_seconds, default=600.0, help="per-shard limit (default 600)")

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
    st.add_argument("--addresses", required=True, type=_addresses, help=addresses_help + "; '|' between replicas")
    st.add_argument("--timeout-s", type=_positive_seconds, default=10.0, help="per-shard limit (default 10)")

    sf = sub.add_parser(
        "serve-from",
        help="pin serving shards to a checkpoint version (roll back), or back to their own source",
        description="Serving shards (ps-server --mode serve) switch to serving the checkpoint CHECKPOINT (a "
        "version number such as 3, or a path under each shard's --checkpoint-root) read-only; a follower "
        "keeps its place meanwhile. --unpin switches them back: a follower catches up with its training shard.",
    )
    sf.add_argument("--addresses", required=True, type=_addresses, help=addresses_help + "; '|' between replicas")
    which = sf.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="checkpoint version or path to serve")
    which.add_argument("--unpin", action="store_true", help="serve the shards' own source again")
    sf.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="per-shard limit (default 30)")

    tb = sub.add_parser("tables", help="list the cluster's tables")
    tb.add_argument("--addresses", required=True, type=_addresses, help=addresses_help + "; '|' between replicas")
    tb.add_argument("--timeout-s", type=_positive_seconds, default=10.0, help="per-shard limit (default 10)")

    ct = sub.add_parser(
        "create-table",
        help="create a table on every shard",
        description="Create NAME on every shard (nothing changes if an identical table exists; a different "
        "one with that name is an error naming each difference). Options are NAME=VALUE: optimizer "
        "(sgd, adagrad, adam, ftrl), initializer (uniform, normal, zeros, constant), seed, serving_default "
        "(zeros, initial) and numbers such as lr=0.05, ttl_seconds=86400, admit_after=2.",
    )
    ct.add_argument("--addresses", required=True, type=_addresses, help=addresses_help)
    ct.add_argument("--name", required=True, help="table name")
    ct.add_argument("--dim", required=True, type=_at_least_one, help="row width")
    ct.add_argument("option", nargs="*", type=_table_option, help="NAME=VALUE settings of the table")
    ct.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="per-shard limit (default 30)")

    hc = sub.add_parser("health", help="gRPC health of every shard and replica (exit 1 unless all serve)")
    hc.add_argument("--addresses", required=True, type=_addresses, help=addresses_help + "; '|' between replicas")
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
            print(f"checkpoint of {manifest['num_shards']} shards written to {args.out.absolute()}")
            _print_rows(manifest)
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
        elif args.command == "serve-from":
            with _cluster(args.addresses, args.timeout_s) as client:
                statuses = client.serve_from(None if args.unpin else args.checkpoint)
            if args.json:
                print(json.dumps(statuses, indent=2, sort_keys=True))
                return 0
            for st in statuses:
                print(f"{st['address']}: serving {st['checkpoint'] or st['source']}, version {st['applied_version']}")
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
