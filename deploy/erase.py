"""``ps-admin erase``: delete a user's rows everywhere they live, and write a receipt that
``ps-admin erase --verify`` checks again.

The keys come from a file: raw keys (``--keys``, one int64 a line) or raw feature values
(``--values`` with ``--feature``, one a line, as they appear in the click log), hashed as
training hashes them (``protos.keys.hash_feature`` with the feature's seed). Then, on the
training shards (``AdminClient.erase``): RAM, the data dir (compacted, so the bytes leave
the disk), every checkpoint under each shard's checkpoint root (rewritten and
compacted) and every rescue dump of its data dir (rewritten); the serving shards that
follow them delete the rows from the change stream: the command waits until each serving
shard named with ``--serving`` has applied the erase, then has each compact its data dir
(``AdminClient.erase_served``). A shard that stops half way completes the erase when it
starts again (``ps.shard.erasing``); the command then says the erase is incomplete, and
running it again finishes it and writes the receipt. Last, every place is asked whether it still holds any of the keys
(``AdminClient.find_erased``), and the receipt says, per place, present or absent.

Example:
    >>> import io
    >>> read_keys(io.StringIO("5\\n-3\\n\\n5\\n"), "keys.txt").tolist()
    [-3, 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import grpc
import numpy as np
import numpy.typing as npt

from client import ClientConfig, PSClient, PSError
from deploy.operations import open_cluster
from deploy.reshard import AdminError
from protos.hashing import hash_strings

__all__ = ["erase", "erase_command", "hash_values", "read_keys", "verify"]

RECEIPT_FORMAT = 1
WAIT_SERVING_S = 60.0
# What an erase call that may have been cut short ends with (anything else refused it first).
_CUT_SHORT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


def read_keys(lines: IO[str], name: str) -> npt.NDArray[np.int64]:
    """The distinct int64 keys of a file, one a line (blank lines skipped); ``AdminError``
    naming the file and line of one that is not an int64."""
    keys = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            value = int(text, 0)
        except ValueError:
            raise AdminError(f"{name}:{n}: {text!r} is not an integer key") from None
        if not -(1 << 63) <= value < 1 << 63:
            raise AdminError(f"{name}:{n}: {value} is outside int64")
        keys.append(value)
    return np.unique(np.array(keys, dtype=np.int64))


def hash_values(lines: IO[bytes], feature: str, seed: int | None) -> npt.NDArray[np.int64]:
    """The distinct keys training gives the raw values of ``feature`` (one a line, bytes as
    in the click log; a line's end is not part of its value)."""
    if seed is None:
        from worker.schema import feature_seed  # the seed training uses by default

        seed = feature_seed(feature)
    values = [line.rstrip(b"\r\n") for line in lines]
    return np.unique(hash_strings(values, seed)) if values else np.zeros(0, np.int64)


def _places(found: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per place (a shard's RAM and disk, each checkpoint part and rescue dump): rows found, present or absent."""
    out, seen = [], set()
    for f in found:
        rows = int(f["erased_ram"]) + int(f["erased_disk"])
        out.append({"place": f"{f['address']} (RAM and data dir)", "rows": rows, "present": rows > 0})
        for c in f["checkpoints"]:
            if c["path"] in seen:  # a part under a root the shards share: every shard finds it
                continue
            seen.add(c["path"])
            kind = "rescue dump" if "rescue-" in Path(c["path"]).name else "checkpoint"
            out.append(
                {"place": f"{f['address']} {kind} {c['path']}", "rows": int(c["rows"]), "present": c["rows"] > 0}
            )
    return out


def _wait_serving(serving: PSClient, versions: Sequence[int], timeout_s: float) -> None:
    """Until every serving replica that follows its training shard applied the erase's
    version (one that serves a checkpoint or a data dir has nothing to apply: ``erase_served``
    loads a pinned checkpoint again)."""
    deadline = time.monotonic() + timeout_s
    while True:
        behind = [
            s["address"]
            for s in serving.admin.stats()
            if s["follow"]["source"] == "follow" and s["follow"]["applied_version"] < versions[s["shard"]]
        ]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise AdminError(
                f"serving shards {', '.join(behind)} did not apply the erase within {timeout_s:.0f} s (not following "
                "their training shard, or behind): they may still serve the rows; run ps-admin erase --verify later"
            )
        time.sleep(0.1)


def erase(
    addresses: Sequence[str | Sequence[str]],
    table: str,
    keys: npt.NDArray[np.int64],
    *,
    serving: Sequence[str | Sequence[str]] | None = None,
    security: ClientConfig | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Erase ``keys`` of ``table`` from the cluster at ``addresses`` (data dirs compacted,
    checkpoints rewritten), wait for the serving shards at ``serving``, check every place;
    returns the receipt."""
    started = time.time()
    served: list[dict[str, Any]] = []
    with open_cluster(addresses, timeout_s, security) as client:
        try:
            answers = client.admin.erase(table, keys, compact=True, checkpoints=True)
        except PSError as exc:
            if exc.code not in _CUT_SHORT:  # refused before anything was erased (a bad table, a token)
                raise
            raise AdminError(
                f"the erase is INCOMPLETE ({exc}): some shards may have erased the keys and others not. A shard "
                "stopped half way completes it when it starts again (its erase journal); a live reshard still "
                "handing keys over finishes with ps-admin scale. Run the same ps-admin erase again to finish it "
                "everywhere and get a receipt",
                code=exc.code,
            ) from None
        found = client.admin.find_erased(table, keys)
    versions = [int(a["version"]) for a in answers]
    if serving:
        with open_cluster(serving, timeout_s, security) as reader:
            _wait_serving(reader, versions, min(timeout_s, WAIT_SERVING_S))
            served = reader.admin.erase_served(table, keys)
            found += reader.admin.find_erased(table, keys, checkpoints=False)
    places = _places(found)
    return {
        "format": RECEIPT_FORMAT,
        "table": table,
        "keys": len(keys),
        "keys_sha256": hashlib.sha256(keys.astype("<i8").tobytes()).hexdigest(),
        "erased_keys": keys.tolist(),
        "started_unix_s": started,
        "took_s": time.time() - started,
        "training": [
            {
                "shard": s,
                "rows_in_ram": a["erased_ram"],
                "rows_on_disk": a["erased_disk"],
                "version": a["version"],
                "compacted": a["compacted"],
                "compact_s": a["compact_s"],
                "checkpoints_rewritten": [{"path": c["path"], "rows": c["rows"]} for c in a["checkpoints"]],
            }
            for s, a in enumerate(answers)
        ],
        "serving": [str(a) for a in (serving or [])],
        "serving_erased": [
            {
                "address": a["address"],
                "rows": int(a["erased_ram"]) + int(a["erased_disk"]),
                "compacted": a["compacted"],
                "compact_s": a["compact_s"],
            }
            for a in served
        ],
        "places": places,
        "absent_everywhere": not any(p["present"] for p in places),
    }


def verify(
    receipt: dict[str, Any],
    addresses: Sequence[str | Sequence[str]],
    *,
    serving: Sequence[str | Sequence[str]] | None = None,
    security: ClientConfig | None = None,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Ask every place again about the receipt's keys; per place, rows found and present."""
    if receipt.get("format") != RECEIPT_FORMAT or "erased_keys" not in receipt:
        raise AdminError(f"not an erase receipt of format {RECEIPT_FORMAT} (no erased_keys)")
    keys = np.array(receipt["erased_keys"], dtype=np.int64)
    if hashlib.sha256(keys.astype("<i8").tobytes()).hexdigest() != receipt.get("keys_sha256"):
        raise AdminError("the receipt's keys do not match its keys_sha256: it was changed")
    with open_cluster(addresses, timeout_s, security) as client:
        found = client.admin.find_erased(receipt["table"], keys)
    if serving:
        with open_cluster(serving, timeout_s, security) as reader:
            found += reader.admin.find_erased(receipt["table"], keys, checkpoints=False)
    return _places(found)


def format_places(places: Sequence[dict[str, Any]]) -> str:
    return "\n".join(f"{'PRESENT' if p['present'] else 'absent '}  {p['rows']:>8}  {p['place']}" for p in places)


def write_receipt(receipt: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(receipt, indent=1))
    tmp.replace(path)


def erase_command(args: argparse.Namespace, security: ClientConfig) -> int:
    """``ps-admin erase`` (its arguments as ``deploy.admin`` parses them); the exit status."""
    if args.verify is not None:
        try:
            receipt = json.loads(args.verify.read_text())
        except (OSError, ValueError) as exc:
            raise AdminError(f"--verify {args.verify}: cannot read the receipt: {exc}") from None
        places = verify(receipt, args.addresses, serving=args.serving, security=security, timeout_s=args.timeout_s)
        print(json.dumps(places, indent=2) if args.json else format_places(places))
        return 1 if any(p["present"] for p in places) else 0
    if not args.table or (args.keys is None and args.values is None):
        raise AdminError("erase: give --table and --keys FILE (or --values FILE --feature F), or --verify RECEIPT")
    if args.values is not None and not args.feature:
        raise AdminError("erase --values: name the feature the values are of with --feature")
    try:
        if args.keys is not None:
            with args.keys.open() as f:
                keys = read_keys(f, str(args.keys))
        else:
            with args.values.open("rb") as fb:
                keys = hash_values(fb, args.feature, args.seed)
    except OSError as exc:
        raise AdminError(f"cannot read {args.keys or args.values}: {exc.strerror}") from None
    receipt = erase(args.addresses, args.table, keys, serving=args.serving, security=security, timeout_s=args.timeout_s)
    if args.receipt is not None:
        write_receipt(receipt, args.receipt)
    if args.json:
        print(json.dumps({k: v for k, v in receipt.items() if k != "erased_keys"}, indent=2))
    else:
        rows = sum(t["rows_in_ram"] + t["rows_on_disk"] for t in receipt["training"])
        rewritten = sum(1 for t in receipt["training"] for c in t["checkpoints_rewritten"] if c["rows"])
        print(
            f"erased {rows} rows of {receipt['keys']} keys from table {args.table} in {receipt['took_s']:.1f} s "
            f"({rewritten} checkpoint parts rewritten)"
        )
        print(format_places(receipt["places"]))
        if args.receipt is not None:
            print(f"receipt: {args.receipt}")
    return 0 if receipt["absent_everywhere"] else 1
