"""``ps-admin``: operations on a whole cluster, or on its checkpoints.

It talks to shards through ``client.PSClient`` and its ``AdminClient`` (one channel setup and
one error tree for every tool) and reads checkpoints offline with ``ps.store``.

* ``ps-admin checkpoint [--addresses A0,A1,...] [--out NAME]``: every shard writes its
  part of the checkpoint NAME to ``NAME/shard-{i:05d}-of-{n:05d}`` under its own
  ``--checkpoint-root`` (default ``<data-dir>/checkpoints``; the Checkpoint RPC, all
  shards in parallel). A relative NAME is resolved under each shard's root, never
  against ps-admin's working directory; an absolute one must lie under every shard's
  root (shards sharing one root). Without ``--out``, NAME is the next version number
  (``000001``, ...: shard 0 picks it, the others follow), as ``AdminClient.checkpoint()``
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
* ``ps-admin scale --addresses A0,A1 --to A0,A1,A2``: a live reshard of a running
  training cluster to more shards (new ones started empty for the new map) or fewer
  (a prefix), while training goes on (``deploy.scale``); run again to finish one that
  was interrupted, ``--abort`` to undo one no shard committed.
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
     "rows": {"table": rows}, "rows_estimated": {"table": bool}, "push_ledgers": "kept" | "dropped", ...}

``rows_estimated`` is true for a table whose count (on some shard) is RocksDB's estimate: the
shard had reopened the table from disk. Printed counts mark it with ``~``, as ``stats`` does.

Example:
    >>> parse_addresses("127.0.0.1:5000, 127.0.0.1:5001+127.0.0.1:5002")
    [['127.0.0.1:5000'], ['127.0.0.1:5001', '127.0.0.1:5002']]
    >>> shard_dir_name(2, 3)
    'shard-00002-of-00003'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from client import ClientConfig
from client import parse_addresses as client_parse_addresses
from deploy.admin_output import (
    format_checkpoints,
    format_embedding_health,
    format_health,
    format_scale,
    format_stats,
    format_tables,
    print_rows,
    scale_json,
)
from deploy.drift import DEFAULT_SAMPLE, drift_command
from deploy.erase import erase_command
from deploy.operations import (
    checkpoint_cluster,
    cluster_health,
    cluster_stats,
    cluster_tables,
    create_table,
    list_checkpoints,
    open_cluster,
    scale_cluster,
)
from deploy.reshard import SCAN_CHUNK_ROWS, AdminError, read_cluster_manifest, reshard, shard_dir_name
from protos.rpc.logs import configure_logging
from ps.store import DataDirError, StorageFailed

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


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number >= 0")
    return value


def _shard_list(text: str) -> list[str]:
    shards = _addresses(text)
    return [_single(shard, "--to") for shard in shards]


def _single(shard: Sequence[str], flag: str) -> str:
    if len(shard) != 1:
        raise argparse.ArgumentTypeError(
            f"{flag}: {'+'.join(shard)} is a shard with replicas; a live reshard takes the training shards"
        )
    return shard[0]


def _table_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. lr=0.05")
    if key in ("optimizer", "initializer", "serving_default", "storage_dtype", "state_dtype"):
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
        "serve-from and unpin). Exit codes: 0 done, 1 failed (stderr says what to do), 2 bad arguments.",
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

    er = sub.add_parser(
        "erase",
        help="delete a user's rows everywhere (shards, disk, serving shards, checkpoints) and write a receipt",
        description="Delete the rows of the keys in --keys FILE (one int64 a line), or of the raw values in "
        "--values FILE of --feature F (one a line, hashed as training hashes them), from TABLE: on every "
        "training shard, in RAM and in the data dir (compacted, so the bytes leave the disk), and in every "
        "checkpoint under each shard's --checkpoint-root and every rescue dump of its data dir (rewritten); the "
        "serving shards that follow them delete them too (name them with --serving to wait for that, compact their "
        "data dirs and check them). A key erased is new again. Then every place is asked again; the receipt "
        "(--receipt, JSON) says what was erased, where, at which version, which checkpoints were rewritten, and, "
        "per place, present or absent. --verify RECEIPT asks every place again. A shard that stops half way "
        "completes the erase when it starts again; the command then says INCOMPLETE: run it again. During a live "
        "reshard it waits for the hand-over of moving keys and erases them on their new owner. Needs an admin "
        "token. Exit status 1 if a place still holds a key or the erase is incomplete.",
    )
    addresses(er)
    er.add_argument("--table", help="the table to erase from")
    keys_from = er.add_mutually_exclusive_group()
    keys_from.add_argument("--keys", type=Path, help="file of raw keys, one int64 a line")
    keys_from.add_argument("--values", type=Path, help="file of raw feature values, one a line (with --feature)")
    keys_from.add_argument(
        "--verify", type=Path, metavar="RECEIPT", help="check every place again for a receipt's keys"
    )
    er.add_argument("--feature", help="with --values: the feature whose values they are")
    er.add_argument(
        "--seed", type=int, default=None, help="with --values: the feature's hash seed (default: training's)"
    )
    er.add_argument("--serving", type=_addresses, default=None, help="the serving shards following the cluster")
    er.add_argument("--receipt", type=Path, default=None, help="where to write the receipt (JSON)")
    er.add_argument("--timeout-s", type=_positive_seconds, default=600.0, help="per-call limit (default 600)")

    dr = sub.add_parser(
        "drift",
        help="how far a table's rows moved since a checkpoint: cosine, L2 change, new and gone keys (sampled)",
        description="Compare TABLE's rows in the checkpoint FROM with those of a later one: the checkpoint --to, "
        "or, without it, one the cluster at --addresses takes now (named drift-STAMP). The checkpoints' files "
        "are read from this machine, over about --sample keys of FROM (a range of the hashed key space). Prints "
        "the mean cosine similarity and L2 change of the rows in both, and the share of keys new and gone; "
        "writes drift.json and drift.png (with matplotlib) to --out.",
    )
    dr.add_argument("--table", required=True, help="the table to compare")
    dr.add_argument(
        "--from",
        dest="src",
        required=True,
        help="the earlier checkpoint: its NAME under a --root (a version number such as 3 works), or its directory",
    )
    dr.add_argument("--to", default=None, help="the later checkpoint, as --from (default: checkpoint the cluster now)")
    dr.add_argument(
        "--addresses",
        type=_addresses,
        default=os.environ.get("PS_ADDRESSES") or None,
        help=f"without --to: {addresses_help} (default: $PS_ADDRESSES)",
    )
    dr.add_argument(
        "--root",
        action="append",
        type=Path,
        default=[],
        help="a shard's --checkpoint-root, where NAMEs are found; repeatable (default: where the new checkpoint landed)",
    )
    dr.add_argument("--sample", type=_at_least_one, default=DEFAULT_SAMPLE, help="keys to compare, about (default 1M)")
    dr.add_argument("--out", type=Path, default=Path("drift"), help="directory for drift.json and drift.png")
    dr.add_argument("--timeout-s", type=_positive_seconds, default=600.0, help="per-shard limit of the checkpoint")

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

    st = sub.add_parser("stats", help="print rows, RAM tier, durability and embedding health of every shard and table")
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

    pb_ = sub.add_parser(
        "publish",
        help="hold or release what online training publishes to --published-only serving shards",
        description="Training shards: --hold refuses the online trainer's publications (serving shards started "
        "with --published-only keep serving the last one) until --release; the trainer logs each refusal. "
        "Without either, says what was published last.",
    )
    addresses(pb_, "TRAINING_ADDRESSES")
    hold = pb_.add_mutually_exclusive_group()
    hold.add_argument("--hold", action="store_true", help="hold publishing")
    hold.add_argument("--release", action="store_true", help="release a hold")
    pb_.add_argument("--timeout-s", type=_positive_seconds, default=10.0, help="per-shard limit (default 10)")

    rb = sub.add_parser(
        "rollback",
        help="have --published-only serving shards serve the publication before the current one",
        description="Serving shards started with --published-only go back one publication (each keeps the last "
        "4); ps-infer scores their rows with that publication's dense weights. Hold publishing first "
        "(ps-admin publish --hold on the training shards), or the trainer's next publication moves them forward "
        "again.",
    )
    addresses(rb, "SERVING_ADDRESSES")
    rb.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="per-shard limit (default 30)")

    tb = sub.add_parser("tables", help="list the cluster's tables")
    addresses(tb)
    tb.add_argument("--timeout-s", type=_positive_seconds, default=10.0, help="per-shard limit (default 10)")

    ct = sub.add_parser(
        "create-table",
        help="create a table on every shard",
        description="Create NAME on every shard (nothing changes if an identical table exists; a different "
        "one with that name is an error naming each difference). Options are NAME=VALUE: optimizer "
        "(sgd, adagrad, adam, ftrl, rowwise_adagrad), initializer (uniform, normal, zeros, constant), seed, serving_default "
        "(zeros, initial) and numbers such as lr=0.05, ttl_seconds=86400, admit_after=2.",
    )
    addresses(ct)
    ct.add_argument("--name", required=True, help="table name")
    ct.add_argument("--dim", required=True, type=_at_least_one, help="row width")
    ct.add_argument("option", nargs="*", type=_table_option, help="NAME=VALUE settings of the table")
    ct.add_argument("--timeout-s", type=_positive_seconds, default=30.0, help="per-shard limit (default 30)")

    sc = sub.add_parser(
        "scale",
        help="grow or shrink a running training cluster while it trains (live reshard)",
        description="Move the running cluster at --addresses to the shards at --to, while training and serving "
        "go on. To grow, --to is --addresses followed by new shards, each started empty as `ps-server --shard J "
        "--num-shards M --data-dir ...` (J its place in --to, M the length of --to); to shrink, --to is the "
        "first shards of --addresses. Only keys whose owner changes move, whole (values, optimizer state, "
        "lifecycle); pushes to them wait a moment (clients retry) while the last changes go over, then clients "
        "learn the new map from the shards. Each shard records where the reshard stands: after any failure "
        "(this command killed, a shard restarted) run the same command again to finish it, or --abort it "
        "before the commit. Needs an admin token on secured shards.",
    )
    addresses(sc)
    sc.add_argument("--to", required=True, type=_shard_list, help="HOST:PORT of every shard of the new cluster, ','")
    sc.add_argument("--abort", action="store_true", help="undo a reshard that no shard committed yet")
    sc.add_argument(
        "--max-rows-per-s",
        type=_non_negative,
        default=0.0,
        help="pace of each copy (one old shard to one new shard), to leave training its share of a busy machine "
        "(default 0: as fast as it goes)",
    )
    sc.add_argument(
        "--serving-to",
        type=_addresses,
        help="the serving shards following the new cluster, ',' between shards, '+' between replicas (the new "
        "ones started as `ps-server --mode serve --shard J --num-shards M --follow TRAINING_J`): they switch "
        "to the new map once caught up, and ps-infer follows",
    )
    sc.add_argument(
        "--serving-addresses",
        type=_addresses,
        default=os.environ.get("SERVING_ADDRESSES") or None,
        help="the serving shards before (default: $SERVING_ADDRESSES); with --serving-to",
    )
    sc.add_argument("--timeout-s", type=_positive_seconds, default=3600.0, help="limit of the whole reshard")

    hc = sub.add_parser("health", help="gRPC health of every shard and replica (exit 1 unless all serve)")
    addresses(hc)
    hc.add_argument("--timeout-s", type=_positive_seconds, default=5.0, help="per-call limit (default 5)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ps-admin`` console script; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    try:
        # TLS and token of every call this command makes: the flags given, else PS_CLIENT_*.
        given = {f: getattr(args, f) for f in ("tls_ca", "tls_cert", "tls_key", "token_file") if getattr(args, f)}
        security = ClientConfig(**given)
        if args.command == "checkpoint":
            manifest = checkpoint_cluster(args.addresses, args.out, args.timeout_s, security)
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
            print_rows(manifest)
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
            print_rows(manifest)
        elif args.command in ("serve-from", "unpin"):
            unpin = args.command == "unpin" or args.unpin
            with open_cluster(args.addresses, args.timeout_s, security) as client:
                statuses = client.admin.serve_from(None if unpin else args.checkpoint)
            if args.json:
                print(json.dumps(statuses, indent=2, sort_keys=True))
                return 0
            for st in statuses:
                print(f"{st['address']}: serving {st['checkpoint'] or st['source']}, version {st['applied_version']}")
        elif args.command == "publish":
            with open_cluster(args.addresses, args.timeout_s, security) as client:
                answers = client.admin.publish(hold=True if args.hold else False if args.release else None)
            if args.json:
                print(json.dumps(answers, indent=2, sort_keys=True))
                return 0
            for i, a in enumerate(answers):
                state = f"held: {a['held_by']}" if a["held_by"] else "not held"
                print(f"shard {i}: last published {a['published'] or 'nothing'}, {state}")
        elif args.command == "rollback":
            with open_cluster(args.addresses, args.timeout_s, security) as client:
                statuses = client.admin.roll_back()
            if args.json:
                print(json.dumps(statuses, indent=2, sort_keys=True))
                return 0
            for st in statuses:
                print(f"{st['address']}: serving publication {st['publication']}, version {st['applied_version']}")
        elif args.command == "drift":
            return drift_command(args, security)
        elif args.command == "erase":
            return erase_command(args, security)
        elif args.command == "list":
            found = list_checkpoints(args.root)
            print(json.dumps(found, indent=2, sort_keys=True) if args.json else format_checkpoints(found))
        elif args.command == "tables":
            tables = cluster_tables(args.addresses, args.timeout_s, security)
            print(json.dumps(tables, indent=2, sort_keys=True) if args.json else format_tables(tables))
        elif args.command == "create-table":
            table = create_table(args.addresses, args.name, args.dim, dict(args.option), args.timeout_s, security)
            print(json.dumps(table, indent=2, sort_keys=True) if args.json else format_tables([table]))
        elif args.command == "scale":
            src = [_single(shard, "--addresses") for shard in args.addresses]
            serving = None
            if args.serving_to is not None:
                if args.serving_addresses is None:
                    raise AdminError(
                        "--serving-to needs --serving-addresses (or $SERVING_ADDRESSES): the serving shards now"
                    )
                serving = (args.serving_addresses, args.serving_to)
            report = scale_cluster(
                src,
                args.to,
                abort=args.abort,
                timeout_s=args.timeout_s,
                serving=serving,
                say=lambda line: print(line, file=sys.stderr, flush=True),
                max_rows_per_s=args.max_rows_per_s,
                security=security,
            )
            print(json.dumps(scale_json(report), indent=2, sort_keys=True) if args.json else format_scale(report))
        elif args.command == "health":
            rows = cluster_health(args.addresses, args.timeout_s, security)
            print(json.dumps(rows, indent=2, sort_keys=True) if args.json else format_health(rows))
            return 0 if all(r["serving"] for r in rows) else 1
        else:
            stats = cluster_stats(args.addresses, args.timeout_s, security)
            if args.json:
                print(json.dumps(stats, indent=2, sort_keys=True))
            else:
                print(format_stats(stats))
                if any(t["health_window_s"] for s in stats for t in s["tables"]):
                    print("\nembedding health (norms: bucket bounds over the latest window)")
                    print(format_embedding_health(stats))
    except AdminError as exc:
        # The status a shard answered, where the message does not say it already: a script
        # can tell a refusal (PERMISSION_DENIED) from a shard it did not reach (UNAVAILABLE).
        status = exc.code.name if exc.code != grpc.StatusCode.UNKNOWN and not str(exc).startswith(exc.code.name) else ""
        print(f"ps-admin {args.command}: {status + ': ' if status else ''}{exc}", file=sys.stderr)
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
