"""What ``ps-admin`` prints: each command's answer as text lines (``--json`` prints the
same dicts as JSON), and the scale report both ways.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from deploy.scale import ScaleReport
from ps.table import bucket_quantile

__all__ = [
    "format_checkpoints",
    "format_embedding_health",
    "format_health",
    "format_scale",
    "format_stats",
    "format_tables",
    "print_rows",
    "scale_json",
]


# After a listing whose row counts are marked with "~" (a checkpoint's ``rows_estimated``).
_CHECKPOINT_ESTIMATE_NOTE = (
    "~ about: RocksDB's estimate of the rows on disk (the shard had reopened the table from disk, so it "
    "counts those rows from the estimate)"
)


def format_checkpoints(found: Sequence[dict[str, Any]]) -> str:
    if not found:
        return "no checkpoints"
    lines = []
    estimated = False
    for c in found:
        parts = c["parts"]
        n = parts[0]["num_shards"]
        shards = ",".join(str(p["shard"]) for p in parts)
        state = "all shards" if c["complete"] else "INCOMPLETE"
        created = max(str(p["created"]) for p in parts)
        rows = sum(p["rows"] for p in parts)
        about = "~" if any(p.get("rows_estimated") for p in parts) else ""
        estimated = estimated or bool(about)
        lines.append(f"{c['name']}: shards {shards} of {n} ({state}), created {created}, {about}{rows} rows")
    if estimated:
        lines.append(_CHECKPOINT_ESTIMATE_NOTE)
    return "\n".join(lines)


# -- printing ----------------------------------------------------------------------------


_SHORT_TYPES = {0: "f32", 1: "f32", 2: "f16", 3: "bf16", 4: "i8"}  # ps.v1.DType numbers: values/state as stored


def _stored(table: dict[str, Any]) -> str:
    """``values/state`` as stored, e.g. ``bf16/f32``; ``i8/-`` for 8-bit serving rows (no state)."""

    def short(number: int) -> str:
        return _SHORT_TYPES.get(number, f"type {number}")

    state = "-" if table["storage_dtype"] == 4 else short(table["state_dtype"])
    return f"{short(table['storage_dtype'])}/{state}"


def format_stats(stats: Sequence[dict[str, Any]]) -> str:
    header = (
        "shard",
        "table",
        "stored",
        "rows",
        "resident",
        "spilled",
        "hit_rate",
        "bytes/row",
        "disk_bytes/row",
        "durability",
        "writable",
    )
    lines: list[tuple[str, ...] | str] = [header]
    estimated = False
    for s in stats:
        shard = f"{s['shard']}/{s['num_shards']}"
        f = s["follow"]
        if s["mode"] == "serve":  # where the rows come from, and how fresh they are
            lag = f" lag={f['lag_versions']}v/{f['lag_s']:.2f}s" + ("" if f["connected"] else f" DOWN: {f['error']}")
            where = {"follow": f"following {f['leader']}{lag}", "checkpoint": f"pinned to {f['checkpoint']}"}
            # A line of its own: a checkpoint path in the table column would pad every row to its width.
            lines.append(
                f"{shard}  [{s['address']} serve, version {s['version']}: {where.get(f['source'], 'data dir')}]"
            )
        durability = s["durability"] or "ram-only"
        if s["mode"] == "serve":
            writable = "read-only (serve)" + (f"; storage NO: {s['storage_error']}" if s["storage_error"] else "")
        else:
            writable = "yes" if s["writable"] else f"NO: {s['storage_error']}"
        if not s["tables"]:
            lines.append((shard, "-", "-", "0", "0", "0", "-", "-", "-", durability, writable))
        for t in s["tables"]:
            about = "~" if t["rows_estimated"] else ""  # RocksDB's estimate: see the note below
            estimated = estimated or bool(about)
            lines.append(
                (
                    shard,
                    t["name"],
                    _stored(t),
                    f"{about}{t['rows']}",
                    str(t["resident_rows"]),
                    f"{about}{t['spilled_rows']}",
                    f"{t['ram_hit_rate']:.3f}",
                    f"{t['bytes_per_resident_row']:.0f}",
                    f"{t['disk_bytes'] / t['rows']:.0f}" if t["disk_bytes"] and t["rows"] else "-",
                    durability,
                    writable,
                )
            )
    rows = [line for line in lines if isinstance(line, tuple)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    table = "\n".join(
        line if isinstance(line, str) else "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
    if estimated:
        table += (
            "\n~ about: the table was reopened from disk, and its rows there are RocksDB's estimate "
            "(shards holding the same keys may differ)"
        )
    return table


def _quantile(h: dict[str, Any], q: float, key: str = "recent") -> float | None:
    """``bucket_quantile`` of a ``Histogram``'s ``key`` counts (``recent``: the latest
    window, falling back to all counted); None if it counted nothing."""
    value = bucket_quantile(h["le"], h[key] if sum(h.get(key) or ()) else h["counts"], q)
    return None if math.isnan(value) else value


def _bound(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "above"
    return f"<={value:.3g}{unit}"


def format_embedding_health(stats: Sequence[dict[str, Any]]) -> str:
    """Per shard and table, the health figures of ``Stats`` (``ps.table.health``): new keys a
    second, rows touched in the window, row and update L2 norms (p50/p99 bucket bounds of
    the latest window), the median idle time of resident rows, sampled rows with NaN/Inf."""
    header = (
        "shard",
        "table",
        "new_keys/s",
        "touched",
        "window",
        "norm_p50",
        "norm_p99",
        "update_p99",
        "idle_p50",
        "nan_rows",
    )
    lines = [header]
    for s in stats:
        shard = f"{s['shard']}/{s['num_shards']}"
        for t in s["tables"]:
            if not t["health_window_s"]:
                lines.append((shard, t["name"], "off", "-", "-", "-", "-", "-", "-", "-"))
                continue
            scanned = bool(t["health_scanned_unix_s"])
            lines.append(
                (
                    shard,
                    t["name"],
                    f"{t['new_keys_per_s']:.1f}",
                    str(t["rows_touched"]) if scanned else "-",
                    f"{t['health_window_s']:g}s",
                    _bound(_quantile(t["row_norm"], 0.5)),
                    _bound(_quantile(t["row_norm"], 0.99)),
                    _bound(_quantile(t["update_norm"], 0.99)),
                    _bound(_quantile(t["row_idle_s"], 0.5, "counts"), "s") if scanned else "-",
                    str(t["nonfinite_rows"]),
                )
            )
    widths = [max(len(row[c]) for row in lines) for c in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in lines)


def format_health(rows: Sequence[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        states = ", ".join(f"{k}={v}" for k, v in r["services"].items())
        hint = f"; {r['hint']}" if r.get("hint") else ""
        lines.append(f"{r['address']}: {'SERVING' if r['serving'] else 'NOT SERVING'} ({states}){hint}")
    return "\n".join(lines)


def format_tables(tables: Sequence[dict[str, Any]]) -> str:
    if not tables:
        return "no tables"
    return "\n".join(
        f"{t['name']}: dim {t['dim']}, optimizer {t['optimizer']}, initializer {t['initializer']}, seed {t['seed']}"
        for t in tables
    )


def scale_json(report: ScaleReport) -> dict[str, Any]:
    return {
        "from": report.src.to_json(),
        "to": report.dst.to_json(),
        "aborted": report.aborted,
        "already_done": report.already_done,
        "rows_moved": report.rows_moved,
        "rows_changed": report.rows_changed,
        "rows_sent": report.rows_sent,
        "bytes_moved": report.bytes_received,
        "received": {str(d): {str(s): n for s, n in by.items()} for d, by in report.received.items()},
        "seconds": report.seconds,
    }


def format_scale(report: ScaleReport) -> str:
    if report.aborted:
        return f"aborted: the cluster stays at {report.src.describe()}"
    if report.already_done:
        return f"nothing to do: the cluster is at {report.dst.describe()}"
    lines = [f"resharded from {report.src.num_shards} to {report.dst.num_shards} shards: {report.dst.describe()}"]
    for d, by_source in sorted(report.received.items()):
        parts = ", ".join(f"{n} from shard {s}" for s, n in sorted(by_source.items()))
        lines.append(f"  shard {d} got {parts}")
    seconds = ", ".join(f"{k} {v:.2f} s" for k, v in report.seconds.items())
    lines.append(
        f"  {report.rows_moved} rows moved, {report.rows_changed} changes to them sent during the move, "
        f"{report.bytes_received / 1e6:.1f} MB in all; {seconds}"
    )
    return "\n".join(lines)


def print_rows(manifest: dict[str, Any]) -> None:
    per_shard = manifest.get("shard_rows") or []
    per_shard_estimated = manifest.get("shard_rows_estimated") or [{} for _ in per_shard]
    estimated = manifest.get("rows_estimated") or {}
    for table, total in sorted((manifest.get("rows") or {}).items()):
        parts = ", ".join(
            f"{'~' if about.get(table) else ''}{r.get(table, 0)}"
            for r, about in zip(per_shard, per_shard_estimated, strict=True)
        )
        print(f"  table {table}: {'~' if estimated.get(table) else ''}{total} rows (by shard: {parts})")
    if not manifest.get("rows"):
        print("  no tables")
    elif any(estimated.values()):
        print(f"  {_CHECKPOINT_ESTIMATE_NOTE}")
