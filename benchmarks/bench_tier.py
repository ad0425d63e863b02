"""RocksDB tier benchmark: what does holding most rows on disk cost a shard?

All in one process, on the shard's own code (``Shard``/``Table``/``Storage``, no gRPC:
the transport is measured by bench_foundation.py, and leaving it out makes the tier's
share of the time larger, not smaller). Three parts, each with its ceiling measured in
the same run (the machine is shared, absolute times drift):

1. Zipf(1.05) training traffic: per step a batch of Zipf-drawn keys, deduplicated, is
   looked up and pushed (dim 16, Adagrad). The table holds N rows; run once with every
   row in RAM (the ceiling) and once with ``--memory-budget-bytes`` at 10% of the rows
   (``interval:5`` durability, the default; ``every-push`` too, for information).
   Goal: tier rows/s >= 0.5x RAM rows/s. RAM hit rate, rows spilled and faulted in.
2. Per-row lookup cost as the key count grows from 1M to 50M (resident + spilled; dim
   8, SGD): N rows are written to RocksDB, a shard opens them with a budget of 10% of
   N, Zipf lookups warm it up, then are timed. Goal: cost per row flat within +-25%.
3. The tier's RocksDB traffic against raw rocksdict doing the same I/O: the tier
   writing dirty rows (``Table.flush``) vs a raw ``WriteBatch`` of the same prebuilt
   records, and the tier faulting rows in (a RAM miss served from disk, through
   ``Table.lookup``) vs a raw multi-get of the same keys.

Usage: ``python benchmarks/bench_tier.py [--quick]`` -> ``benchmarks/results/tier.{json,png}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import rocksdict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from ps.config import Durability, TableSpec  # noqa: E402
from ps.optimizers import OptimizerKind, OptimizerParams  # noqa: E402
from ps.shard import Shard  # noqa: E402
from ps.storage import Storage  # noqa: E402
from ps.table import Table  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
BATCH = 16_384  # Zipf draws per step (before dedup)
ZIPF_S = 1.05
BUDGET_FRACTION = 0.10


class Zipf:
    """Keys drawn with P(rank r) ~ r^-s over ``n`` keys; ranks map to scattered int64 keys."""

    def __init__(self, n: int, s: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        weights = np.arange(1, n + 1, dtype=np.float64) ** -s
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.keys = key_space(n)
        self.rng.shuffle(self.keys)

    def batch(self, size: int) -> npt.NDArray[np.int64]:
        ranks = np.searchsorted(self.cdf, self.rng.random(size))
        return np.unique(self.keys[np.minimum(ranks, self.keys.shape[0] - 1)])


def key_space(n: int) -> npt.NDArray[np.int64]:
    """``n`` distinct, well-spread int64 keys (a fixed odd multiplier: a bijection)."""
    return (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


def adagrad_spec(dim: int) -> TableSpec:
    return TableSpec("t", dim, optimizer=OptimizerParams(kind=OptimizerKind.ADAGRAD, lr=0.05), seed=3)


def open_shard(tmp: Path | None, durability: str, budget: int) -> Shard:
    if tmp is None:
        return Shard(0, 1)
    storage = Storage(tmp, shard=0, num_shards=1)
    return Shard(0, 1, storage, Durability.parse(durability), budget)


def populate(shard: Shard, table: Table, keys: npt.NDArray[np.int64], chunk: int = 1 << 16) -> None:
    for start in range(0, keys.shape[0], chunk):
        table.lookup(keys[start : start + chunk])
        shard.after_request()


# -- part 1 ------------------------------------------------------------------------------


def zipf_training(n: int, steps: int, warmup: int, durability: str | None, tmp: Path) -> dict[str, Any]:
    """Lookup + push of Zipf batches on a table of ``n`` rows; ``durability`` None = all RAM."""
    spec = adagrad_spec(16)
    probe = Table(spec)
    budget = int(BUDGET_FRACTION * n * probe.bytes_per_row) if durability else 0
    data_dir = tmp / f"zipf-{durability}" if durability else None
    shard = open_shard(data_dir, durability or "", budget)
    shard.create_table(spec)
    table = shard.table("t")
    shard.start()
    zipf = Zipf(n, ZIPF_S, seed=11)
    populate(shard, table, zipf.keys)
    grads_rng = np.random.default_rng(5)
    seq = 0

    def step() -> int:
        nonlocal seq
        keys = zipf.batch(BATCH)
        table.lookup(keys)
        shard.after_request()
        seq += 1
        grads = grads_rng.standard_normal((keys.shape[0], spec.dim), dtype=np.float32) * np.float32(0.01)
        shard.push([(table, keys, grads)], "bench", seq)
        return int(keys.shape[0])

    for _ in range(warmup):
        step()
    c0 = dict(vars(table.counters))
    t0 = time.perf_counter()
    rows = sum(step() for _ in range(steps))
    elapsed = time.perf_counter() - t0
    c1 = dict(vars(table.counters))
    hits, misses = c1["ram_hits"] - c0["ram_hits"], c1["ram_misses"] - c0["ram_misses"]
    out = {
        "mode": "all in RAM" if durability is None else f"budget 10%, {durability}",
        "rows": n,
        "steps": steps,
        "unique_keys_per_step": rows / steps,
        "rows_per_s": 2 * rows / elapsed,  # each key is looked up and pushed
        "step_ms": 1e3 * elapsed / steps,
        "ram_hit_rate": hits / max(hits + misses, 1),
        "faulted_in_per_step": (c1["rows_faulted_in"] - c0["rows_faulted_in"]) / steps,
        "spilled_per_step": (c1["rows_spilled"] - c0["rows_spilled"]) / steps,
        "resident_rows": len(table),
        "budget_bytes": budget,
        "resident_bytes": shard.resident_bytes(),
    }
    shard.close()
    shard.shutdown()
    if data_dir is not None:
        shutil.rmtree(data_dir, ignore_errors=True)
    return out


def zipf_served(n: int, steps: int, warmup: int, durability: str | None, tmp: Path) -> dict[str, Any]:
    """Part 1 end to end: a real ``ps-server`` process and a ``PSClient`` over loopback gRPC."""
    from client import PSClient
    from deploy.local import start_shard, stop_shard

    spec = adagrad_spec(16)
    budget = int(BUDGET_FRACTION * n * Table(spec).bytes_per_row) if durability else 0
    root = tmp / f"served-{durability}"
    args = [f"--data-dir={root / 'data'}", f"--memory-budget-bytes={budget}", f"--durability={durability}"] if durability else []
    shard = start_shard(0, 1, root, *args)
    try:
        with PSClient([shard.address]) as client:
            client.create_table("t", 16, optimizer="adagrad", lr=0.05, seed=3)
            zipf = Zipf(n, ZIPF_S, seed=11)
            for start in range(0, n, 1 << 16):
                client.lookup("t", zipf.keys[start : start + (1 << 16)])
            grads_rng = np.random.default_rng(5)

            def step() -> int:
                keys = zipf.batch(BATCH)
                client.lookup("t", keys)
                grads = grads_rng.standard_normal((keys.shape[0], spec.dim), dtype=np.float32) * np.float32(0.01)
                client.push("t", keys, grads)
                return int(keys.shape[0])

            for _ in range(warmup):
                step()
            s0 = client.stats()[0]["tables"][0]
            t0 = time.perf_counter()
            rows = sum(step() for _ in range(steps))
            elapsed = time.perf_counter() - t0
            s1 = client.stats()[0]
            t1 = s1["tables"][0]
    finally:
        stop_shard(shard)
    hits = t1.get("ram_hits", 0) - s0.get("ram_hits", 0)
    misses = t1.get("ram_misses", 0) - s0.get("ram_misses", 0)
    out = {
        "mode": ("all in RAM" if durability is None else f"budget 10%, {durability}") + " (gRPC)",
        "rows": n,
        "steps": steps,
        "unique_keys_per_step": rows / steps,
        "rows_per_s": 2 * rows / elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "ram_hit_rate": hits / max(hits + misses, 1) if durability else 1.0,
        "faulted_in_per_step": (t1.get("rows_faulted_in", 0) - s0.get("rows_faulted_in", 0)) / steps,
        "spilled_per_step": (t1.get("rows_spilled", 0) - s0.get("rows_spilled", 0)) / steps,
        "resident_rows": t1.get("resident_rows", 0),
        "budget_bytes": budget,
        "resident_bytes": s1.get("resident_bytes", 0),
    }
    shutil.rmtree(root, ignore_errors=True)
    return out


# -- part 2 ------------------------------------------------------------------------------


def lookup_cost(n: int, warmup: int, steps: int, tmp: Path) -> dict[str, Any]:
    """µs per looked-up row with ``n`` rows stored, 10% of them resident."""
    spec = TableSpec("t", 8, seed=3)  # SGD: no optimizer state
    data_dir = tmp / f"scale-{n}"
    zipf = Zipf(n, ZIPF_S, seed=13)
    t0 = time.perf_counter()
    with Storage(data_dir, shard=0, num_shards=1) as storage:
        from ps.config import spec_to_proto

        storage.save_spec("t", spec_to_proto(spec).SerializeToString())
        rows = storage.table("t", 8, 0)
        chunk = 1 << 20
        values = np.random.default_rng(0).standard_normal((chunk, 8), dtype=np.float32)
        stamp = np.zeros(chunk, np.uint32)
        for start in range(0, n, chunk):
            keys = zipf.keys[start : start + chunk]
            batch = storage.batch()
            rows.put(batch, keys, values[: keys.shape[0]], np.empty((keys.shape[0], 0), np.float32),
                     stamp[: keys.shape[0]], stamp[: keys.shape[0]])  # fmt: skip
            storage.commit(batch)
        write_s = time.perf_counter() - t0
        # Measure the steady state of a long-running shard, not the compactions that a
        # bulk load leaves running in the background (they would take the second core).
        storage.flush_memtables()
        storage.compact()
    budget = int(BUDGET_FRACTION * n * Table(spec).bytes_per_row)
    ready_s = restart_time(data_dir, budget, tmp)
    shard = open_shard(data_dir, "interval:5", budget)
    table = shard.table("t")
    # Fill RAM to the budget with the most popular keys (ranks come first in zipf.keys),
    # then let Zipf traffic settle the resident set.
    fill = int(0.85 * budget / table.bytes_per_row)
    for start in range(0, fill, 1 << 16):
        table.lookup(zipf.keys[start : min(fill, start + (1 << 16))])
        shard.after_request()
    for _ in range(warmup):
        table.lookup(zipf.batch(BATCH))
        shard.after_request()
    c0 = dict(vars(table.counters))
    looked = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        keys = zipf.batch(BATCH)
        table.lookup(keys)
        shard.after_request()
        looked += keys.shape[0]
    elapsed = time.perf_counter() - t0
    c1 = dict(vars(table.counters))
    hits, misses = c1["ram_hits"] - c0["ram_hits"], c1["ram_misses"] - c0["ram_misses"]
    out = {
        "rows": n,
        "resident_rows": len(table),
        "us_per_row": 1e6 * elapsed / looked,
        "ram_hit_rate": hits / max(hits + misses, 1),
        "populate_rows_per_s": n / write_s,
        "restart_ready_s": ready_s,
    }
    shard.close()
    shard.shutdown()
    shutil.rmtree(data_dir, ignore_errors=True)
    return out


def restart_time(data_dir: Path, budget: int, tmp: Path) -> float:
    """Seconds from starting a real ``ps-server`` on ``data_dir`` to its port file, plus
    its first lookup (rows fault in lazily, so this is what "ready" costs)."""
    from client import PSClient
    from deploy.local import start_shard, stop_shard

    t0 = time.perf_counter()
    shard = start_shard(0, 1, tmp / "restart", f"--data-dir={data_dir}", f"--memory-budget-bytes={budget}")
    try:
        with PSClient([shard.address]) as client:
            client.tables()
            client.lookup("t", np.arange(1024, dtype=np.int64))
        ready = time.perf_counter() - t0
    finally:
        stop_shard(shard)
    return ready


# -- part 3 ------------------------------------------------------------------------------


def io_vs_raw(n: int, tmp: Path) -> dict[str, Any]:
    """Tier flush / fault-in vs raw rocksdict WriteBatch / multi-get of the same records."""
    spec = adagrad_spec(16)
    keys = key_space(n)
    chunk = 1 << 16
    res: dict[str, Any] = {"rows": n, "record_bytes": 4 * (16 + 16 + 2)}

    # Tier: n new (dirty) rows, written by flush(); then all evicted and faulted back in.
    storage = Storage(tmp / "io-tier", shard=0, num_shards=1)
    shard = Shard(0, 1, storage, Durability.parse("checkpoint-only"))
    shard.create_table(spec)
    table = shard.table("t")
    for start in range(0, n, chunk):
        table.lookup(keys[start : start + chunk])
    t0 = time.perf_counter()
    written = table.flush()
    res["tier_write_rows_per_s"] = written / (time.perf_counter() - t0)
    table.evict(len(table))
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        table.lookup(keys[start : start + chunk])
    res["tier_read_rows_per_s"] = n / (time.perf_counter() - t0)
    assert table.counters.rows_faulted_in == n, table.counters
    shard.shutdown()

    # Raw rocksdict: the same records, keys and values prebuilt as bytes outside the timing.
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_compression_type(rocksdict.DBCompressionType.none())
    opts.set_write_buffer_size(64 << 20)
    db = rocksdict.Rdict(str(tmp / "io-raw"), opts)
    key_bytes = keys.astype(">i8").view("V8").tolist()
    value_bytes = np.random.default_rng(1).random((n, 34), dtype=np.float32).view("V136").ravel().tolist()
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        batch = rocksdict.WriteBatch(raw_mode=True)
        for k, v in zip(key_bytes[start : start + chunk], value_bytes[start : start + chunk], strict=True):
            batch.put(k, v)
        db.write(batch)
    res["raw_write_rows_per_s"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        got = db.get(key_bytes[start : start + chunk])
        assert got[0] is not None
    res["raw_read_rows_per_s"] = n / (time.perf_counter() - t0)
    db.close()
    del db
    res["write_ratio"] = res["tier_write_rows_per_s"] / res["raw_write_rows_per_s"]
    res["read_ratio"] = res["tier_read_rows_per_s"] / res["raw_read_rows_per_s"]
    return res


# -- report --------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> str:
    lines = [""]
    for part, title in (("served", "1a. Zipf(1.05) lookup+push through gRPC: ps-server process + PSClient"),
                        ("zipf", "1b. The same on the shard's own code, in process (no transport)")):  # fmt: skip
        lines.append(f"{title}; dim 16 Adagrad, batch of {BATCH} draws deduplicated")
        lines.append(f"{'mode':<36}{'rows':>11}{'rows/s':>12}{'ratio':>8}{'hit rate':>10}{'faults/step':>13}{'step ms':>9}")
        ram = res[part][0]["rows_per_s"]
        for r in res[part]:
            lines.append(
                f"{r['mode']:<36}{r['rows']:>11,}{r['rows_per_s']:>12,.0f}{r['rows_per_s'] / ram:>7.2f}x"
                f"{r['ram_hit_rate']:>10.3f}{r['faulted_in_per_step']:>13,.0f}{r['step_ms']:>9.1f}"
            )
        tier = res[part][1]["rows_per_s"] / ram
        lines.append(f"   budget-10% (interval:5) / all-RAM = {tier:.2f}x (goal >= 0.5x: {'PASS' if tier >= 0.5 else 'FAIL'})")
        lines.append("")
    lines.append("2. Per-row lookup cost vs rows stored (10% resident, dim 8 SGD, Zipf lookups)")
    lines.append(f"{'rows':>12}{'resident':>11}{'us/row':>9}{'hit rate':>10}{'vs first':>10}{'restart ready s':>17}")
    first = res["scale"][0]["us_per_row"]
    for r in res["scale"]:
        lines.append(
            f"{r['rows']:>12,}{r['resident_rows']:>11,}{r['us_per_row']:>9.3f}{r['ram_hit_rate']:>10.3f}"
            f"{r['us_per_row'] / first:>9.2f}x{r['restart_ready_s']:>17.2f}"
        )
    costs = [r["us_per_row"] for r in res["scale"]]
    spread = max(costs) / min(costs) - 1
    mid = (max(costs) + min(costs)) / 2
    within = max(abs(c - mid) / mid for c in costs)
    lines.append(f"   goal: flat within +-25%: max/min - 1 = {spread:.0%}, +-{within:.0%} around the middle "
                 f"{'PASS' if within <= 0.25 else 'FAIL'}")  # fmt: skip
    io = res["io"]
    lines.append("")
    lines.append(f"3. RocksDB I/O, {io['rows']:,} rows of {io['record_bytes']} B: tier vs raw rocksdict")
    lines.append(f"{'':<8}{'tier rows/s':>14}{'raw rows/s':>14}{'ratio':>8}")
    lines.append(f"{'write':<8}{io['tier_write_rows_per_s']:>14,.0f}{io['raw_write_rows_per_s']:>14,.0f}{io['write_ratio']:>7.2f}x")
    lines.append(f"{'read':<8}{io['tier_read_rows_per_s']:>14,.0f}{io['raw_read_rows_per_s']:>14,.0f}{io['read_ratio']:>7.2f}x")
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    modes = ["all RAM", "10%, interval:5", "10%, every-push"]
    x = np.arange(len(modes))
    for off, part, label in ((-0.2, "served", "gRPC ps-server"), (0.2, "zipf", "in process")):
        ram = res[part][0]["rows_per_s"]
        axes[0].bar(x + off, [r["rows_per_s"] / ram for r in res[part]], 0.4, label=label)
    axes[0].axhline(0.5, ls="--", color="k", lw=0.8, label="goal 0.5x")
    axes[0].set_xticks(x, modes)
    axes[0].set_ylabel("rows/s relative to all-RAM")
    axes[0].set_title("Zipf(1.05) lookup+push")
    axes[0].legend()
    s = res["scale"]
    axes[1].plot([r["rows"] / 1e6 for r in s], [r["us_per_row"] for r in s], "o-")
    axes[1].set_xscale("log")
    axes[1].set_ylim(0, max(r["us_per_row"] for r in s) * 1.4)
    axes[1].set_xlabel("rows stored (M), 10% resident")
    axes[1].set_ylabel("µs per looked-up row")
    axes[1].set_title("Lookup cost vs table size")
    io = res["io"]
    x = np.arange(2)
    axes[2].bar(x - 0.2, [io["tier_write_rows_per_s"] / 1e6, io["tier_read_rows_per_s"] / 1e6], 0.4, label="tier")
    axes[2].bar(x + 0.2, [io["raw_write_rows_per_s"] / 1e6, io["raw_read_rows_per_s"] / 1e6], 0.4, label="raw rocksdict")
    axes[2].set_xticks(x, ["write", "read"])
    axes[2].set_ylabel("M rows/s")
    axes[2].set_title("RocksDB I/O: tier vs raw")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(quick: bool, only: str | None = None) -> None:
    started = time.perf_counter()
    n_zipf = 400_000 if quick else 2_000_000
    sizes = [1_000_000, 4_000_000] if quick else [1_000_000, 5_000_000, 10_000_000, 25_000_000, 50_000_000]
    steps, warmup = (30, 10) if quick else (120, 40)
    res: dict[str, Any] = {"machine": platform.platform(), "quick": quick, "batch": BATCH, "zipf_s": ZIPF_S}
    with tempfile.TemporaryDirectory(prefix="bench-tier-") as d:
        tmp = Path(d)
        res["zipf"], res["served"] = [], []
        for durability in (None, "interval:5", "every-push") if only in (None, "zipf") else ():
            res["served"].append(zipf_served(n_zipf, steps, warmup, durability, tmp))
            print(res["served"][-1], flush=True)
            res["zipf"].append(zipf_training(n_zipf, steps, warmup, durability, tmp))
            print(res["zipf"][-1], flush=True)
            gc.collect()
        res["scale"] = []
        for n in sizes if only in (None, "scale") else ():
            res["scale"].append(lookup_cost(n, warmup=60, steps=60, tmp=tmp))
            print(res["scale"][-1], flush=True)
            gc.collect()
        if only in (None, "io"):
            res["io"] = io_vs_raw(200_000 if quick else 1_000_000, tmp)
    res["wall_s"] = time.perf_counter() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"tier-{only}" if only else "tier"
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    if only:
        print(json.dumps(res, indent=1, default=str))
        return
    print(report(res))
    try:
        chart(res, RESULTS / "tier.png")
    except ImportError:
        print("(matplotlib not installed: no chart; pip install '.[bench]')")
    print(f"wall {res['wall_s']:.0f} s; wrote {RESULTS}/tier.{{json,png}}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--only", choices=["zipf", "scale", "io"], help="run one part (its own JSON file)")
    args = parser.parse_args()
    main(args.quick, args.only)
