"""Cluster checkpoints offline: read one (``read_cluster_manifest``) and rewrite it for
another number of shards (``reshard``); ``ps-admin reshard`` runs it.

Every row, with its optimizer state, ``last_access`` and ``frequency``, goes bit for bit
to the shard ``protos.keys.shard_of(key, M)`` assigns. Push ledgers are not carried
over: a resharded cluster is a new cluster and its clients start fresh.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from client.errors import PSError
from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.durability import part_name
from ps.errors import ShardError
from ps.store import FORMAT_VERSION, DataDirError, Storage, read_manifest, write_manifest
from ps.table import TableSpec, spec_from_proto, spec_to_proto

__all__ = ["SCAN_CHUNK_ROWS", "AdminError", "now_stamp", "read_cluster_manifest", "reshard", "shard_dir_name"]

log = logging.getLogger(__name__)

SCAN_CHUNK_ROWS = 1 << 16
_LEDGERS_DROPPED = (
    "dropped: a resharded cluster is a new cluster; its clients start fresh (exactly-once "
    "records of pushes made before the reshard are not kept)"
)


class AdminError(PSError):
    """A ``ps-admin`` operation failed; the message says what to do (exit code 1). A
    ``client.PSError``, as every error of the system a caller sees is."""


def shard_dir_name(shard: int, num_shards: int) -> str:
    """The directory of shard ``shard`` inside a cluster checkpoint (``ps.durability.checkpoint.part_name``)."""
    return part_name(shard, num_shards)


def now_stamp() -> tuple[float, str]:
    """Now as (unix seconds, ISO 8601 UTC text), for manifests."""
    t = time.time()
    return t, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def read_cluster_manifest(path: Path) -> dict[str, Any]:
    """The cluster manifest of ``path``; ``AdminError`` saying why it is not a cluster checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise AdminError(f"{path}: no such directory")
    try:
        manifest = read_manifest(path)
    except DataDirError as exc:
        raise AdminError(
            f"{exc} (a cluster checkpoint written by `ps-admin checkpoint` ends with its manifest.json; "
            "without one it is incomplete)"
        ) from None
    if "shards" not in manifest:
        if "shard" in manifest:
            raise AdminError(
                f"{path} is the checkpoint of one shard, not of a cluster: pass the directory that "
                "`ps-admin checkpoint --out` wrote (it holds shard-*-of-* directories)"
            )
        raise AdminError(f"{path}/manifest.json: no 'shards' list: not a cluster checkpoint")
    shards, n = manifest["shards"], manifest.get("num_shards")
    if not isinstance(shards, list) or not isinstance(n, int) or len(shards) != n or n < 1:
        raise AdminError(f"{path}/manifest.json: num_shards={n!r} does not match its shards list {shards!r}")
    if manifest.get("format") != FORMAT_VERSION:
        raise AdminError(f"{path}: checkpoint format {manifest.get('format')!r}, this ps-admin reads {FORMAT_VERSION}")
    return manifest


def _open_sources(src: Path, manifest: dict[str, Any], stack: contextlib.ExitStack) -> list[Storage]:
    n = int(manifest["num_shards"])
    sources = []
    for i, name in enumerate(manifest["shards"]):
        path = src / str(name)
        try:
            st = stack.enter_context(Storage(path, shard=-1, num_shards=0, read_only=True))
        except DataDirError as exc:
            raise AdminError(f"cannot read shard {i} of {src}: {exc}") from None
        if (st.shard, st.num_shards) != (i, n):
            raise AdminError(
                f"{path} holds shard {st.shard} of {st.num_shards}, but {src}/manifest.json lists it as "
                f"shard {i} of {n}: the checkpoint is damaged"
            )
        sources.append(st)
    return sources


def _source_specs(sources: Sequence[Storage]) -> dict[str, tuple[TableSpec, bytes, list[int]]]:
    """Every table of the source shards: its spec, the stored spec bytes and which shards hold it."""
    found: dict[str, tuple[TableSpec, bytes, list[int]]] = {}
    for i, st in enumerate(sources):
        for name, blob in st.specs().items():
            try:
                spec = spec_from_proto(pb.TableSpec.FromString(blob))
            except (ShardError, ValueError) as exc:
                raise AdminError(f"{st.path}: stored spec of table {name!r} is unreadable: {exc}") from None
            if name in found:
                known = found[name][0]
                diff = known.differences(spec)
                if diff:
                    raise AdminError(
                        f"table {name!r} differs between shards {found[name][2][0]} and {i}: {'; '.join(diff)}"
                    )
                found[name][2].append(i)
            else:
                found[name] = (spec, blob, [i])
    return found


def reshard(src: Path, num_shards: int, out: Path, chunk_rows: int = SCAN_CHUNK_ROWS) -> dict[str, Any]:
    """Write the cluster checkpoint ``src`` again as ``num_shards`` shards into ``out``.

    Offline: reads ``src`` (read-only) and writes ``out``, which must not exist. Every
    row with its optimizer state, ``last_access`` and ``frequency`` goes to the shard
    ``shard_of(key, num_shards)`` names. Push ledgers are not carried over. Returns the
    new cluster manifest. Raises ``AdminError``; on failure ``out`` is removed.
    """
    if num_shards < 1:
        raise AdminError(f"--to-shards {num_shards}: must be >= 1")
    if chunk_rows < 1:
        raise AdminError(f"chunk_rows={chunk_rows}: must be >= 1")
    src, out = Path(src).absolute(), Path(out).absolute()
    manifest = read_cluster_manifest(src)
    if out.exists():
        raise AdminError(f"--out {out} exists: choose a new directory (reshard never overwrites one)")
    try:
        out.mkdir(parents=True)
    except OSError as exc:
        raise AdminError(f"cannot create --out {out}: {exc.strerror}") from None
    try:
        return _reshard_into(src, manifest, num_shards, out, chunk_rows)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _reshard_into(src: Path, manifest: dict[str, Any], m: int, out: Path, chunk_rows: int) -> dict[str, Any]:
    names = [shard_dir_name(j, m) for j in range(m)]
    rows: list[dict[str, int]] = [{} for _ in range(m)]
    with contextlib.ExitStack() as stack:
        sources = _open_sources(src, manifest, stack)
        tables = _source_specs(sources)
        targets = [stack.enter_context(Storage(out / name, shard=j, num_shards=m)) for j, name in enumerate(names)]
        for name, (spec, blob, holders) in sorted(tables.items()):
            fmt = spec.row_format
            outs = []
            for j, t in enumerate(targets):
                t.save_spec(name, blob)
                outs.append(t.table(name, fmt))
                rows[j][name] = 0
            for i in holders:
                for stored in sources[i].table(name, fmt).scan(chunk_rows):
                    dest = shard_of(stored.keys, m)
                    # One stable sort groups the chunk by destination; each gets one batch.
                    order = np.argsort(dest, kind="stable")
                    bounds = np.searchsorted(dest[order], np.arange(m + 1))
                    for j in np.flatnonzero(np.diff(bounds)).tolist():
                        sel = order[bounds[j] : bounds[j + 1]]
                        batch = targets[j].batch()
                        outs[j].put(batch, stored[sel])
                        targets[j].commit(batch)
                        rows[j][name] += int(sel.shape[0])
            log.info("resharded table=%s rows=%d", name, sum(r[name] for r in rows))
        for t in targets:
            t.flush_memtables()
    # Every Storage is closed here: its lock files can go, and the manifests come last.
    created_unix_s, created = now_stamp()
    specs_json = [json_format.MessageToDict(spec_to_proto(tables[n][0])) for n in sorted(tables)]
    origin = {"path": str(src), "num_shards": int(manifest["num_shards"])}
    for j, name in enumerate(names):
        (out / name / "ps.lock").unlink(missing_ok=True)
        write_manifest(
            out / name,
            {
                "format": FORMAT_VERSION,
                "shard": j,
                "num_shards": m,
                "version": name,
                "created_unix_s": created_unix_s,
                "created": created,
                "tables": specs_json,
                "rows": rows[j],
                "resharded_from": origin,
                "push_ledgers": _LEDGERS_DROPPED,
            },
        )
    cluster: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "kind": "cluster",
        "num_shards": m,
        "shards": names,
        "created_unix_s": created_unix_s,
        "created": created,
        "tables": specs_json,
        "rows": {n: sum(r[n] for r in rows) for n in sorted(tables)},
        "shard_rows": rows,
        "resharded_from": origin,
        "push_ledgers": _LEDGERS_DROPPED,
    }
    write_manifest(out, cluster)
    log.info("reshard written path=%s from=%s shards=%d->%d", out, src, origin["num_shards"], m)
    return cluster
