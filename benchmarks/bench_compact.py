"""Compact rows: what 16-bit storage saves, and what it costs in speed.

One run measures, each figure next to its float32 peer from the same run:

1. Resident bytes per row: RSS growth of a fresh process inserting N keys (default
   10M) into a dim-64 Adagrad ``Table`` stored as float32, bfloat16 values + float32
   state, bfloat16 both, and as a serving shard's 8-bit table (``--serve-dtype int8``:
   codes, a scale and a bias, no optimizer state); and with row-wise Adagrad (one float32
   accumulator per row), float32 or bfloat16 values; next to the bytes the memory budget
   charges per row. ``--memory-only`` runs just this part.
3. Lookups of 64Ki keys x dim 64 from one ``ps-server`` (1M-row tables), the wire
   float32 or bfloat16 (``ClientConfig.transport_dtype``), from a float32 and from a
   bfloat16 table, rounds interleaved; beside them a float32 dim-32 table, whose replies
   are as many bytes as a 16-bit dim-64 one with nothing to convert.
4. Bytes per row on disk: ``Stats.disk_bytes`` of each layout's rows, once pushed, flushed
   and compacted, with RocksDB block compression none, lz4 and zstd.
2. Rows in a fixed RAM budget: the Zipf(1.05) tier workload of ``tier_zipf.py`` at dim
   64 (a budget that holds 10% of the float32 rows), every-push-free (checkpoint-only
   durability), float32 vs bfloat16 both: resident rows at the end, RAM hit rate, and
   the median step time over the timed steps.

Usage: ``python benchmarks/bench_compact.py [--quick] [--rows N]``
-> ``benchmarks/results/compact.{json,png}``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tier_zipf import ZIPF_S, Zipf  # noqa: E402

from client import ClientConfig, PSClient  # noqa: E402
from deploy import LocalCluster  # noqa: E402
from protos.wire import tune_malloc  # noqa: E402
from ps.durability import Durability  # noqa: E402
from ps.shard import Shard  # noqa: E402
from ps.store import (  # noqa: E402
    COMPRESSIONS,
    Storage,
    precision,  # noqa: E402
)
from ps.table import (  # noqa: E402
    OptimizerKind,
    OptimizerParams,
    Table,  # noqa: E402
    TableSpec,  # noqa: E402
)

RESULTS = REPO / "benchmarks" / "results"
DIM = 64
ADAGRAD = OptimizerParams(OptimizerKind.ADAGRAD, lr=0.05)
ROWWISE = OptimizerParams(OptimizerKind.ROWWISE_ADAGRAD, lr=0.05)
LAYOUTS = {  # name -> (values, state, optimizer)
    "float32": ("float32", "float32", ADAGRAD),
    "bf16 values": ("bfloat16", "float32", ADAGRAD),
    "bf16 both": ("bfloat16", "bfloat16", ADAGRAD),
    "int8 serving": ("int8", "float32", ADAGRAD),  # a serving shard's table: codes, scale and bias, no state
    "rowwise fp32": ("float32", "float32", ROWWISE),  # one float32 accumulator per row
    "rowwise bf16": ("bfloat16", "float32", ROWWISE),
}
# Resident bytes per row vs float32 (per-element Adagrad), at most.
GOALS = {"bf16 values": 0.65, "bf16 both": 0.40, "int8 serving": 0.20, "rowwise fp32": 0.60, "rowwise bf16": 0.40}
TIER_GOAL = 1.8  # rows held in the same budget, bf16 both vs float32, at least
WIRE_GOAL = 1.4  # 16-bit lookups (bfloat16 table, bfloat16 wire) vs float32, times faster, at least
BATCH = 16_384


def spec(layout: str, name: str = "t") -> TableSpec:
    values, state, optimizer = LAYOUTS[layout]
    return TableSpec(name, DIM, optimizer=optimizer, seed=3, storage_dtype=values, state_dtype=state)


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_child(layout: str, n: int) -> dict[str, Any]:
    """RSS growth per row of a table holding ``n`` keys (run in a fresh process)."""
    tune_malloc()
    warm = Table(spec(layout, "warm"))  # loads the kernels first (a few rows: little heap to reuse)
    warm.lookup(np.arange(10_000))
    batch = min(n, 1_000_000)
    base = np.arange(batch, dtype=np.int64)
    # np.ones, not np.zeros: calloc'ed pages would become resident during the measurement.
    keys, out = np.ones_like(base), np.ones((batch, DIM), np.float32)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = rss_bytes()
    table = Table(spec(layout))
    for start in range(0, n, batch):
        np.multiply(base + start, 0x9E3779B97F4A7C15 - (1 << 64), out=keys)
        table.lookup(keys, out=out)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after = rss_bytes()
    assert len(table) == n
    return {"rows": n, "bytes_per_row": (after - before) / n, "charged_bytes_per_row": table.bytes_per_row}


def memory(n: int) -> dict[str, Any]:
    out = {}
    for layout in LAYOUTS:
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-child", layout, "--rows", str(n)],
            capture_output=True,
            text=True,
            check=True,
        )
        out[layout] = json.loads(proc.stdout.splitlines()[-1])
        print(f"  {layout}: {out[layout]['bytes_per_row']:.1f} B/row", file=sys.stderr)
    base = out["float32"]["bytes_per_row"]
    for m in out.values():
        m["ratio"] = m["bytes_per_row"] / base
    return out


def tier(n: int, steps: int, warmup: int, tmp: Path) -> dict[str, Any]:
    """Same budget (10% of the float32 rows), float32 vs bfloat16 both."""
    zipf = Zipf(n, ZIPF_S, seed=11)
    batches = [zipf.batch(BATCH) for _ in range(warmup + steps)]
    grads = np.random.default_rng(5).standard_normal((BATCH, DIM), dtype=np.float32) * np.float32(0.01)
    budget = int(0.10 * n * Table(spec("float32")).bytes_per_row)
    out: dict[str, Any] = {"budget_bytes": budget, "rows": n}
    for layout in ("float32", "bf16 both"):
        data = tmp / layout.replace(" ", "-")
        storage = Storage(data, shard=0, num_shards=1)
        shard = Shard(0, 1, storage, Durability.parse("checkpoint-only"), budget)
        shard.create_table(spec(layout))
        table = shard.table("t")
        shard.start()
        for start in range(0, n, 1 << 16):
            table.lookup(zipf.keys[start : start + (1 << 16)])
            shard.budget.after_request()
        times = []
        for seq, keys in enumerate(batches, 1):
            t0 = time.perf_counter()
            table.lookup(keys)
            shard.budget.after_request()
            table.push(keys, grads[: keys.shape[0]], client_id="bench", seq=seq)
            shard.budget.after_request()
            if seq == warmup:
                c0 = dict(vars(table.counters))
            if seq > warmup:
                times.append(time.perf_counter() - t0)
        c1 = dict(vars(table.counters))
        hits, misses = c1["ram_hits"] - c0["ram_hits"], c1["ram_misses"] - c0["ram_misses"]
        out[layout] = {
            "resident_rows": len(table),
            "charged_bytes_per_row": table.bytes_per_row,
            "ram_hit_rate": hits / max(1, hits + misses),
            "step_ms": 1e3 * statistics.median(times),
        }
        shard.close()
        shard.shutdown()
        print(f"  {layout}: {out[layout]}", file=sys.stderr)
    out["rows_ratio"] = out["bf16 both"]["resident_rows"] / out["float32"]["resident_rows"]
    out["step_ratio"] = out["bf16 both"]["step_ms"] / out["float32"]["step_ms"]
    return out


def values_and_state_floor(memory: dict[str, Any]) -> dict[str, float]:
    """Bytes of values and optimizer state alone (dim elements each, one state element per row
    for row-wise Adagrad) over float32's measured bytes per row: no layout of these types can
    go below it."""
    base = memory["float32"]["bytes_per_row"]

    def raw(layout: str) -> int:
        values, state, optimizer = LAYOUTS[layout]
        if values == precision.INT8:
            return DIM + 8  # codes, scale and bias
        width = 1 if optimizer.kind == OptimizerKind.ROWWISE_ADAGRAD else DIM
        return DIM * precision.itemsize(values) + width * precision.itemsize(state)

    return {k: raw(k) / base for k in memory}


def disk(rows: int, tmp: Path) -> dict[str, Any]:
    """RocksDB file bytes per row (``Stats.disk_bytes``) of float32 and bfloat16 rows, once
    pushed, by block compression."""
    out: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(2)
    keys = np.arange(rows, dtype=np.int64) * 7919
    grads = rng.standard_normal((rows, DIM)).astype(np.float32)
    for layout in [k for k in LAYOUTS if LAYOUTS[k][0] != precision.INT8]:
        for compression in COMPRESSIONS:
            path = tmp / f"disk-{layout.replace(' ', '-')}-{compression}"
            with Storage(path, shard=0, num_shards=1, compression=compression) as st:
                table = Table(spec(layout), rows=st.table("t", spec(layout).row_format), storage=st)
                table.push(keys, grads)
                table.flush()
                st.flush_memtables()
                st.compact()
                out.setdefault(layout, {})[compression] = table.disk_bytes() / rows
    return {"rows": rows, "bytes_per_row": out}


def wire(rows: int, rounds: int) -> dict[str, Any]:
    """Median lookup latency of every (table type, wire type), and the dim-32 float32 floor."""
    n = 65_536
    rng = np.random.default_rng(0)
    sets = [rng.choice(rows, n, replace=False).astype(np.int64) * 7919 for _ in range(8)]
    times: dict[str, list[float]] = {}
    with LocalCluster(num_shards=1) as cluster:
        clients = {w: PSClient(cluster.addresses, ClientConfig(transport_dtype=w)) for w in ("float32", "bfloat16")}
        tables = {"float32": DIM, "bfloat16": DIM, "half": DIM // 2}
        with PSClient(cluster.addresses) as ps:
            for name, dim in tables.items():
                stored = "float32" if name == "half" else name
                ps.create_table(name, dim, optimizer="adagrad", storage_dtype=stored)
                for start in range(0, rows, n):
                    ps.lookup(name, np.arange(start, min(rows, start + n), dtype=np.int64) * 7919)
        cases = [(t, w) for t in ("float32", "bfloat16") for w in clients] + [("half", "float32")]
        for _ in range(rounds):
            for table, w in cases:
                out = np.empty((n, tables[table]), np.float32)
                for keys in sets:
                    t0 = time.perf_counter()
                    clients[w].lookup(table, keys, out=out)
                    times.setdefault(f"{table} table, {w} wire", []).append(time.perf_counter() - t0)
        for c in clients.values():
            c.close()
    res: dict[str, Any] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    base = res["float32 table, float32 wire"]
    res["ratio"] = base / res["bfloat16 table, bfloat16 wire"]
    res["float32_table_ratio"] = base / res["float32 table, bfloat16 wire"]
    res["floor_ratio"] = base / res["half table, float32 wire"]
    return res


def report(res: dict[str, Any]) -> str:
    lines = [
        f"Resident bytes per row, dim {DIM}, Adagrad per element or per row (rowwise), "
        f"{res['memory']['float32']['rows']:,} rows (RSS growth)"
    ]
    lines.append(f"{'layout':<14}{'B/row':>9}{'charged':>9}{'vs fp32':>9}{'goal':>8}")
    for layout, m in res["memory"].items():
        goal = f"<={GOALS[layout]:.2f}" if layout in GOALS else "-"
        mark = "" if layout not in GOALS else (" ok" if m["ratio"] <= GOALS[layout] else " MISSED")
        lines.append(
            f"{layout:<14}{m['bytes_per_row']:>9.1f}{m['charged_bytes_per_row']:>9}{m['ratio']:>9.3f}{goal:>8}{mark}"
        )
    floors = ", ".join(f"{k} {v:.3f}" for k, v in values_and_state_floor(res["memory"]).items())
    lines.append(f"floor: values and optimizer state alone (no index or metadata) vs float32's measured row: {floors}")
    t = res.get("tier")
    if t is None:
        return "\n".join(lines)
    lines.append("")
    lines.append(f"Zipf tier, budget {t['budget_bytes'] / 2**20:.0f} MiB (10% of the float32 rows of {t['rows']:,})")
    for layout in ("float32", "bf16 both"):
        m = t[layout]
        lines.append(
            f"{layout:<14} resident {m['resident_rows']:>9,}  hit rate {m['ram_hit_rate']:.3f}  step {m['step_ms']:.1f} ms"
        )
    ok = "ok" if t["rows_ratio"] >= TIER_GOAL else "MISSED"
    lines.append(
        f"rows held: {t['rows_ratio']:.2f}x (goal >= {TIER_GOAL}: {ok}); step time ratio {t['step_ratio']:.2f}"
    )
    if "wire" in res:
        w = res["wire"]
        lines += ["", "Lookup of 64Ki keys x dim 64, one shard (median ms)"]
        lines += [f"{k:<34}{v:>8.2f}" for k, v in w.items() if k.endswith("wire")]
        ok = "ok" if w["ratio"] >= WIRE_GOAL else "MISSED"
        lines.append(
            f"16-bit (bfloat16 table and wire) vs float32: {w['ratio']:.2f}x faster (goal >= {WIRE_GOAL}: {ok}); "
            f"float32 table, bfloat16 wire {w['float32_table_ratio']:.2f}x; floor (same bytes, nothing to convert) "
            f"{w['floor_ratio']:.2f}x"
        )
    if "disk" in res:
        lines += ["", f"RocksDB bytes per row on disk ({res['disk']['rows']:,} rows, flushed and compacted)"]
        for layout, by in res["disk"]["bytes_per_row"].items():
            lines.append(f"{layout:<14}" + "  ".join(f"{c} {b:6.1f}" for c, b in by.items()))
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = "tier" in res
    fig, axes = plt.subplots(1, 3 if full else 1, figsize=(15 if full else 7, 4), squeeze=False)
    a, *rest = axes[0]
    names = list(res["memory"])
    colors = ["gray", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:red"]
    a.bar(names, [res["memory"][k]["bytes_per_row"] for k in names], color=colors[: len(names)])
    a.set_ylabel("resident bytes per row")
    a.set_title(f"dim {DIM}, Adagrad per element or per row")
    a.tick_params(axis="x", labelsize=7)
    if not full:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    b, c = rest
    t = res["tier"]
    b.bar(
        ["float32", "bf16 both"],
        [t["float32"]["resident_rows"], t["bf16 both"]["resident_rows"]],
        color=["gray", "tab:green"],
    )
    b.set_ylabel("rows in RAM, same budget")
    b.set_title(f"Zipf tier: {t['rows_ratio']:.2f}x rows")
    w = {k.replace(" table, ", "\n").replace(" wire", ""): v for k, v in res["wire"].items() if k.endswith("wire")}
    c.bar(list(w), list(w.values()), color="tab:blue")
    c.set_ylabel("ms per 64Ki x 64 lookup (median)")
    c.set_title(f"16-bit lookups: {res['wire']['ratio']:.2f}x faster")
    c.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M rows, fewer tier steps")
    parser.add_argument("--rows", type=int, default=None, help="rows of the memory part (default 10M, quick 1M)")
    parser.add_argument("--memory-only", action="store_true", help="only the resident bytes per row")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.rows)))
        return
    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    res: dict[str, Any] = {"memory": memory(rows)}
    if args.memory_only:
        print(report(res))
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "compact-memory.json").write_text(json.dumps(res, indent=1))
        chart(res, RESULTS / "compact-memory.png")
        return
    with tempfile.TemporaryDirectory() as tmp:
        n = 200_000 if args.quick else 1_000_000
        res["tier"] = tier(n, steps=100 if args.quick else 300, warmup=200 if args.quick else 600, tmp=Path(tmp))
        res["disk"] = disk(100_000 if args.quick else 500_000, Path(tmp))
    res["wire"] = wire(1_000_000, rounds=3 if args.quick else 6)
    print(report(res))
    RESULTS.mkdir(exist_ok=True)
    name = "compact-quick" if args.quick else "compact"
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1))
    chart(res, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
