"""``ps-admin drift``: how far a table's rows moved between two checkpoints.

The rows are read from the checkpoints' files (offline, as ``ps-admin reshard`` reads them):
the part of every shard, over a sample of the key space: the keys whose unsigned 64-bit value
lies in ``[0, span)``, with ``span`` chosen so that about ``sample`` of the older checkpoint's
rows fall in it. The keys training produces are hashes, spread evenly, so a range of them is
an even sample; small raw keys (0, 1, 2, ...) all fall at the start of it. RocksDB holds rows
in that very order, so the sample is read as one range scan per shard, never a full one.

Over the keys in both: the mean cosine similarity of each row with its earlier self and the
mean L2 distance between them (histograms of both); over the keys of either: the share that is
new (only in the later checkpoint) and gone (only in the earlier one).

Example:
    >>> a = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    >>> b = np.array([[1.0, 0.0], [0.0, -2.0]], np.float32)
    >>> [round(float(x), 3) for x in cosine(a, b)], [round(float(x), 3) for x in np.linalg.norm(a - b, axis=1)]
    ([1.0, -1.0], [0.0, 4.0])
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from client import ClientConfig
from deploy.operations import checkpoint_cluster, list_checkpoints
from deploy.reshard import AdminError
from protos import ps_pb2 as pb
from ps.store import DataDirError, Storage, precision
from ps.table import TableSpec, spec_from_proto

__all__ = [
    "DEFAULT_SAMPLE",
    "DriftReport",
    "checkpoint_name",
    "cosine",
    "drift_command",
    "drift",
    "find_checkpoint",
    "format_drift",
    "write_drift",
]

DEFAULT_SAMPLE = 1_000_000
_CHUNK = 65_536
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class DriftReport:
    """What ``drift`` found (``asdict`` is the JSON it writes)."""

    table: str
    older: str
    newer: str
    key_span: int  # keys (as uint64) in [0, key_span) were compared
    older_rows: int  # in the span
    newer_rows: int
    both: int  # keys in both checkpoints' span
    new_share: float  # of the newer's keys, those the older lacks
    gone_share: float  # of the older's keys, those the newer lacks
    mean_cosine: float  # over ``both`` (nan if none)
    mean_l2_change: float
    max_l2_change: float
    cosine_hist: dict[str, list[float]]  # bucket edges and counts
    l2_change_hist: dict[str, list[float]]
    seconds: float


def cosine(a: F32, b: F32) -> npt.NDArray[np.float64]:
    """Row-wise cosine similarity of ``a`` and ``b`` (1.0 where both rows are zero; 0.0 where one is)."""
    dot = np.einsum("ij,ij->i", a, b, dtype=np.float64)
    na = np.sqrt(np.einsum("ij,ij->i", a, a, dtype=np.float64))
    nb = np.sqrt(np.einsum("ij,ij->i", b, b, dtype=np.float64))
    out = np.divide(dot, na * nb, out=np.zeros_like(dot), where=(na * nb) > 0)
    out[(na == 0) & (nb == 0)] = 1.0
    clipped: npt.NDArray[np.float64] = np.clip(out, -1.0, 1.0)
    return clipped


def find_checkpoint(roots: Sequence[Path], name: str) -> list[Path]:
    """The shard parts of checkpoint ``name`` (a name under ``roots``, a version number such
    as ``3``, or a path), in shard order. ``AdminError`` if none or if parts are missing."""
    path = Path(name)
    if path.is_dir():
        dirs = [path] if (path / "db").is_dir() else sorted(path.glob("shard-*-of-*"))
        parts = [{"path": str(d)} for d in dirs]
        n = len(parts)
    else:
        found = {c["name"]: c for c in list_checkpoints(roots)}
        key = f"{int(name):06d}" if name.isdigit() and f"{int(name):06d}" in found else name
        if key not in found:
            known = ", ".join(sorted(found)) or "none"
            raise AdminError(f"checkpoint {name!r}: not under {', '.join(map(str, roots))} (there: {known})")
        parts = sorted(found[key]["parts"], key=lambda p: int(p["shard"]))
        n = int(parts[0]["num_shards"])
        shards = [int(p["shard"]) for p in parts]
        if shards != list(range(n)):
            raise AdminError(
                f"checkpoint {name!r}: parts of shards {shards} found, of {n}: give --root for every shard's "
                "checkpoint root"
            )
    if not parts:
        raise AdminError(f"{name}: no checkpoint parts (shard-*-of-* directories) there")
    return [Path(p["path"]) for p in parts]


def checkpoint_name(parts: Sequence[Path]) -> str:
    """The name of the checkpoint whose shard parts are ``parts`` (its directory's name)."""
    first = Path(parts[0])
    return first.parent.name if first.name.startswith("shard-") else first.name


def _read(parts: Sequence[Path], table: str, span: int | None) -> tuple[TableSpec, npt.NDArray[np.int64], F32, int]:
    """``(spec, keys, values as float32, rows in the table)`` of ``table`` in every part, for
    keys in ``[0, span)`` (None: every key); keys sorted (as uint64)."""
    keys, values, spec, total = [], [], None, 0
    for path in parts:
        with contextlib.ExitStack() as stack:
            try:
                st = stack.enter_context(Storage(path, shard=-1, num_shards=0, read_only=True))
            except DataDirError as exc:
                raise AdminError(f"cannot read {path}: {exc}") from None
            blob = st.specs().get(table)
            if blob is None:
                raise AdminError(f"{path}: no table {table!r} (tables: {', '.join(sorted(st.specs())) or 'none'})")
            spec = spec_from_proto(pb.TableSpec.FromString(blob))
            rows = st.table(table, spec.row_format)
            total += rows.estimate_rows()
            for chunk in rows.scan(_CHUNK, 0, span):
                keys.append(chunk.keys)
                values.append(precision.decode(spec.storage_dtype, chunk.values))
    assert spec is not None
    k = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    v = np.concatenate(values) if values else np.zeros((0, spec.dim), np.float32)
    order = np.argsort(k.view(np.uint64), kind="stable")
    return spec, k[order], np.asarray(v[order], np.float32), total


def drift(
    older: Sequence[Path],
    newer: Sequence[Path],
    table: str,
    sample: int = DEFAULT_SAMPLE,
    names: tuple[str, str] = ("older", "newer"),
) -> DriftReport:
    """Compare ``table`` in the checkpoint parts ``older`` and ``newer`` over about ``sample``
    keys of the older one (see the module)."""
    t0 = time.perf_counter()
    rows_older = 0
    for path in older:  # the table's size, to size the span (RocksDB's estimate: cheap)
        with Storage(path, shard=-1, num_shards=0, read_only=True) as st:
            blob = st.specs().get(table)
            if blob is None:
                raise AdminError(f"{path}: no table {table!r} (tables: {', '.join(sorted(st.specs())) or 'none'})")
            rows_older += st.table(table, spec_from_proto(pb.TableSpec.FromString(blob)).row_format).estimate_rows()
    span = None if rows_older <= sample else int((1 << 64) * sample / rows_older)
    spec_a, ka, va, _ = _read(older, table, span)
    spec_b, kb, vb, _ = _read(newer, table, span)
    if spec_a.dim != spec_b.dim:
        raise AdminError(f"table {table!r} has dim {spec_a.dim} in {names[0]} and {spec_b.dim} in {names[1]}")
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    cos = cosine(va[ia], vb[ib])
    change = np.linalg.norm((vb[ib] - va[ia]).astype(np.float64), axis=1)
    both = int(ia.shape[0])
    cos_counts, cos_edges = np.histogram(cos, bins=40, range=(-1.0, 1.0))
    top = float(change.max()) if both else 1.0
    l2_counts, l2_edges = np.histogram(change, bins=40, range=(0.0, top if top > 0 else 1.0))
    return DriftReport(
        table=table,
        older=names[0],
        newer=names[1],
        key_span=(1 << 64) if span is None else span,
        older_rows=int(ka.shape[0]),
        newer_rows=int(kb.shape[0]),
        both=both,
        new_share=(kb.shape[0] - both) / kb.shape[0] if kb.shape[0] else 0.0,
        gone_share=(ka.shape[0] - both) / ka.shape[0] if ka.shape[0] else 0.0,
        mean_cosine=float(cos.mean()) if both else math.nan,
        mean_l2_change=float(change.mean()) if both else math.nan,
        max_l2_change=float(change.max()) if both else math.nan,
        cosine_hist={"edges": cos_edges.tolist(), "counts": cos_counts.tolist()},
        l2_change_hist={"edges": l2_edges.tolist(), "counts": l2_counts.tolist()},
        seconds=time.perf_counter() - t0,
    )


def format_drift(r: DriftReport) -> str:
    share = r.key_span / (1 << 64)
    lines = [
        f"table {r.table}: {r.older} -> {r.newer} (keys sampled: {share:.2%} of the key space)",
        f"  rows compared      {r.both} (in {r.older}: {r.older_rows}, in {r.newer}: {r.newer_rows})",
        f"  mean cosine        {r.mean_cosine:.4f}",
        f"  mean L2 change     {r.mean_l2_change:.4g} (max {r.max_l2_change:.4g})",
        f"  new keys           {r.new_share:.2%} of {r.newer}'s",
        f"  gone keys          {r.gone_share:.2%} of {r.older}'s",
        f"  read and compared in {r.seconds:.2f} s",
    ]
    return "\n".join(lines)


def write_drift(r: DriftReport, out: Path) -> list[Path]:
    """``drift.json`` and, where matplotlib is installed, ``drift.png`` (histograms) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "drift.json"]
    written[0].write_text(json.dumps(asdict(r), indent=2))
    try:
        import matplotlib
    except ImportError:
        return written
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, hist, label in ((a, r.cosine_hist, "cosine similarity"), (b, r.l2_change_hist, "L2 change")):
        edges = np.asarray(hist["edges"])
        ax.bar(edges[:-1], hist["counts"], width=np.diff(edges), align="edge")
        ax.set(xlabel=label, ylabel="rows")
    fig.suptitle(f"{r.table}: {r.older} -> {r.newer} ({r.both} rows)")
    fig.tight_layout()
    fig.savefig(out / "drift.png", dpi=100)
    plt.close(fig)
    written.append(out / "drift.png")
    return written


def drift_command(args: argparse.Namespace, security: ClientConfig) -> int:
    """``ps-admin drift`` (its arguments as ``deploy.admin`` parses them); the exit status."""
    roots: list[Path] = list(args.root)
    if args.to is None:
        if args.addresses is None:
            raise AdminError("drift: give --to CHECKPOINT, or --addresses to checkpoint the cluster now")
        name = time.strftime("drift-%Y%m%dT%H%M%SZ", time.gmtime())
        taken = checkpoint_cluster(args.addresses, name, args.timeout_s, security)
        newer = [Path(p) for p in taken["parts"]]
        print(f"checkpointed the cluster as {name}", file=sys.stderr)
        roots = roots or sorted({p.parent.parent for p in newer})
    else:
        name = args.to
        newer = find_checkpoint(roots, args.to)
    older = find_checkpoint(roots, args.src)
    report = drift(older, newer, args.table, args.sample, (checkpoint_name(older), checkpoint_name(newer)))
    written = write_drift(report, args.out)
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2, sort_keys=True))
    else:
        print(format_drift(report))
        print(
            f"wrote {', '.join(map(str, written))}"
            + ("" if len(written) > 1 else " (no PNG: matplotlib is not installed)")
        )
    return 0
