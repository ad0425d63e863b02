"""RocksDB tier benchmark: what does holding most rows on disk cost a shard?

Three parts, each with its ceiling measured in the same run (the machine is shared,
absolute times drift):

1. Zipf(1.05) training traffic (``tier_zipf.py``): batches of Zipf-drawn keys looked up
   and pushed (dim 16, Adagrad), all drawn before timing. With every row in RAM (the
   ceiling) and with ``--memory-budget-bytes`` at 10% of the rows (``interval:5``
   durability, the default, with LFU eviction, the default, and with LRU; ``every-push``
   too, for information); through gRPC (a ``ps-server`` process and ``PSClient``) and in
   process. Every run first creates all the rows (so the RAM starts with the least
   popular ones), then warms up for 600 steps: LFU eviction learns which rows are
   popular from their lookup counts, and its hit rate climbs from ~0.4 to its steady
   state over about that many (the curve is in the JSON). Then 300 steps are timed. Runs
   alternate and repeat; medians are reported. Goals (interval:5, LFU, through gRPC):
   tier rows/s >= 0.35x RAM rows/s, RAM hit rate >= 0.72. Rows faulted in and written
   per step, and the raw RocksDB I/O floor of those rows.
2. Per-row lookup cost as the key count grows from 1M to 50M (resident + spilled; dim
   8, SGD): N rows are written to RocksDB, a shard opens them with a budget of 10% of
   N, Zipf lookups warm it up, then are timed. Goal: cost per row flat within +-25%.
3. The tier's RocksDB traffic against raw rocksdict doing the same I/O: the tier
   writing dirty rows (``Table.flush``) vs a raw ``WriteBatch`` of the same prebuilt
   records, and the tier faulting rows in (a RAM miss served from disk, through
   ``Table.lookup``) vs a raw multi-get of the same keys.

Usage: ``python benchmarks/bench_tier.py [--quick] [--only zipf|scale|io]``
-> ``benchmarks/results/tier.{json,png}``.
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
import rocksdict

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tier_zipf and headlines, beside this file

from headlines import TIER_GOAL  # noqa: E402
from headlines import TIER_HIT_RATE_GOAL as HIT_RATE_GOAL  # noqa: E402
from tier_zipf import (  # noqa: E402
    BATCH,
    BUDGET_FRACTION,
    REPO,
    ZIPF_S,
    Workload,
    Zipf,
    adagrad_spec,
    in_process,
    io_floor,
    key_space,
    served,
)

from ps.durability import Durability  # noqa: E402
from ps.shard import Shard  # noqa: E402
from ps.store import (
    RowFormat,
    Rows,
    Storage,  # noqa: E402
)
from ps.table import (
    Table,  # noqa: E402
    TableSpec,  # noqa: E402
)

RESULTS = REPO / "benchmarks" / "results"
MODES = (None, "interval:5", "interval:5/lru", "every-push")  # see tier_zipf.mode_name


def open_shard(tmp: Path | None, durability: str, budget: int) -> Shard:
    if tmp is None:
        return Shard(0, 1)
    storage = Storage(tmp, shard=0, num_shards=1)
    return Shard(0, 1, storage, Durability.parse(durability), budget)


# -- part 1 ------------------------------------------------------------------------------


def zipf_runs(n: int, steps: int, warmup: int, repeats: int, tmp: Path) -> dict[str, Any]:
    """Part 1: every mode, through gRPC and in process, alternating, ``repeats`` times;
    the run with the median rows/s of each stands for it. Then the I/O floor."""
    work = Workload(n, steps, warmup)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"served": {}, "zipf": {}}
    for _ in range(repeats):
        for durability in MODES:
            for part, run in (("served", served), ("zipf", in_process)):
                r = run(work, durability, tmp)
                runs[part].setdefault(r["mode"], []).append(r)
                print(r, flush=True)
                gc.collect()
    out: dict[str, Any] = {"runs": runs}
    for part, by_mode in runs.items():
        out[part] = [sorted(rs, key=lambda r: r["rows_per_s"])[len(rs) // 2] for rs in by_mode.values()]
    tier = out["served"][1]
    # The writes no design avoids: every row that left RAM (the interval flush comes on
    # top, at a rate a short timed window samples unevenly).
    out["floor"] = io_floor(n, round(tier["faulted_in_per_step"]), round(tier["spilled_per_step"]), steps, tmp)
    return out


# -- part 2 ------------------------------------------------------------------------------


def lookup_cost(n: int, warmup: int, steps: int, tmp: Path) -> dict[str, Any]:
    """µs per looked-up row with ``n`` rows stored, 10% of them resident."""
    spec = TableSpec("t", 8, seed=3)  # SGD: no optimizer state
    data_dir = tmp / f"scale-{n}"
    zipf = Zipf(n, ZIPF_S, seed=13)
    t0 = time.perf_counter()
    with Storage(data_dir, shard=0, num_shards=1) as storage:
        from ps.table import spec_to_proto

        storage.save_spec("t", spec_to_proto(spec).SerializeToString())
        rows = storage.table("t", RowFormat(8, 0))
        chunk = 1 << 20
        values = np.random.default_rng(0).standard_normal((chunk, 8), dtype=np.float32)
        stamp = np.zeros(chunk, np.uint32)
        for start in range(0, n, chunk):
            keys = zipf.keys[start : start + chunk]
            batch = storage.batch()
            n_keys = keys.shape[0]
            empty = np.empty((n_keys, 0), np.float32)
            rows.put(batch, Rows(keys, values[:n_keys], empty, stamp[:n_keys], stamp[:n_keys]))
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
        shard.budget.after_request()
    for _ in range(warmup):
        table.lookup(zipf.batch(BATCH))
        shard.budget.after_request()
    c0 = dict(vars(table.counters))
    looked = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        keys = zipf.batch(BATCH)
        table.lookup(keys)
        shard.budget.after_request()
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
            client.admin.tables()
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
    z = res["zipf_part"]
    for part, title in (
        ("served", "1a. Zipf(1.05) lookup+push through gRPC: ps-server process + PSClient"),
        ("zipf", "1b. The same on the shard's own code, in process (no transport)"),
    ):
        lines.append(f"{title}; dim 16 Adagrad, batch of {BATCH} draws deduplicated, median of {res['repeats']} runs")
        lines.append(
            f"{'mode':<36}{'rows':>11}{'rows/s':>12}{'ratio':>8}{'hit rate':>10}{'faults/step':>13}"
            f"{'writes/step':>13}{'step ms':>9}"
        )
        ram = z[part][0]["rows_per_s"]
        for r in z[part]:
            lines.append(
                f"{r['mode']:<36}{r['rows']:>11,}{r['rows_per_s']:>12,.0f}{r['rows_per_s'] / ram:>7.2f}x"
                f"{r['ram_hit_rate']:>10.3f}{r['faulted_in_per_step']:>13,.0f}{r['written_per_step']:>13,.0f}{r['step_ms']:>9.2f}"
            )
        tier, hit = z[part][1]["rows_per_s"] / ram, z[part][1]["ram_hit_rate"]
        curve = ", ".join(f"{h:.2f}" for h in z[part][1].get("warmup_hit_rates", []))
        lines.append(f"   hit rate of the budget-10% (interval:5) run while warming up, per 100 steps: {curve}")
        lines.append(
            f"   budget-10% (interval:5) / all-RAM = {tier:.2f}x (goal >= {TIER_GOAL}x: "
            f"{'PASS' if tier >= TIER_GOAL else 'FAIL'}); hit rate {hit:.3f} (goal >= {HIT_RATE_GOAL}: "
            f"{'PASS' if hit >= HIT_RATE_GOAL else 'FAIL'})"
        )
        lines.append("")
    f, ram, tier = z["floor"], z["served"][0], z["served"][1]
    io = f["read_ms"] + f["write_ms"]
    lines.append(
        f"1c. Raw rocksdict I/O of one gRPC tier step ({tier['faulted_in_per_step']:,.0f} rows read by one multi-get, "
        f"{tier['spilled_per_step']:,.0f} spilled rows written by one batch), single thread"
    )
    r_ms = ram["step_ms"]
    lines.append(
        f"   read {f['read_ms']:.2f} ms + write {f['write_ms']:.2f} ms = {io:.2f} ms a step; all-RAM step {r_ms:.2f} ms"
    )
    lines.append(
        f"   best ratio any design doing this I/O could reach here: {r_ms / (r_ms + io):.2f}x if the I/O overlaps "
        f"nothing, {r_ms / (r_ms + io / f['cores']):.2f}x if spread perfectly over {f['cores']:.0f} cores; "
        f"the tier: {r_ms / tier['step_ms']:.2f}x"
    )
    lines.append(
        f"   a Python thread beside that I/O (on another thread) stalls {f['python_stalled_beside_read']:.0%} of the "
        f"time during the reads, {f['python_stalled_beside_write']:.0%} during the writes: a rocksdict write "
        "holds the GIL, so it cannot overlap the shard's request handling"
    )
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
    lines.append(
        f"   goal: flat within +-25%: max/min - 1 = {spread:.0%}, +-{within:.0%} around the middle "
        f"{'PASS' if within <= 0.25 else 'FAIL'}"
    )
    io = res["io"]
    lines.append("")
    lines.append(f"3. RocksDB I/O, {io['rows']:,} rows of {io['record_bytes']} B: tier vs raw rocksdict")
    lines.append(f"{'':<8}{'tier rows/s':>14}{'raw rows/s':>14}{'ratio':>8}")
    lines.append(
        f"{'write':<8}{io['tier_write_rows_per_s']:>14,.0f}{io['raw_write_rows_per_s']:>14,.0f}{io['write_ratio']:>7.2f}x"
    )
    lines.append(
        f"{'read':<8}{io['tier_read_rows_per_s']:>14,.0f}{io['raw_read_rows_per_s']:>14,.0f}{io['read_ratio']:>7.2f}x"
    )
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = {
        None: "all RAM",
        "interval:5": "10%, LFU\ninterval:5",
        "interval:5/lru": "10%, LRU\ninterval:5",
        "every-push": "10%, LFU\nevery-push",
    }
    modes = [labels[m] for m in MODES]
    x = np.arange(len(modes))
    for off, part, label in ((-0.2, "served", "gRPC ps-server"), (0.2, "zipf", "in process")):
        ram = res["zipf_part"][part][0]["rows_per_s"]
        axes[0].bar(x + off, [r["rows_per_s"] / ram for r in res["zipf_part"][part]], 0.4, label=label)
    axes[0].axhline(TIER_GOAL, ls="--", color="k", lw=0.8, label=f"goal {TIER_GOAL}x")
    f, r_ms = res["zipf_part"]["floor"], res["zipf_part"]["served"][0]["step_ms"]
    io = f["read_ms"] + f["write_ms"]
    for bound, style, what in (
        (r_ms / (r_ms + io), ":", "serial"),
        (r_ms / (r_ms + io / f["cores"]), "-.", "on all cores"),
    ):
        axes[0].hlines(bound, 0.55, 1.45, colors="C2", linestyles=style, label=f"raw I/O bound, {what}")
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
    axes[2].bar(
        x + 0.2, [io["raw_write_rows_per_s"] / 1e6, io["raw_read_rows_per_s"] / 1e6], 0.4, label="raw rocksdict"
    )
    axes[2].set_xticks(x, ["write", "read"])
    axes[2].set_ylabel("M rows/s")
    axes[2].set_title("RocksDB I/O: tier vs raw")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(quick: bool, only: str | None = None, warmup_steps: int | None = None) -> None:
    started = time.perf_counter()
    n_zipf = 400_000 if quick else 2_000_000
    sizes = [1_000_000, 4_000_000] if quick else [1_000_000, 5_000_000, 10_000_000, 25_000_000, 50_000_000]
    steps, warmup, repeats = (30, 10, 1) if quick else (300, 600, 3)
    warmup = warmup if warmup_steps is None else warmup_steps
    res: dict[str, Any] = {
        "machine": platform.platform(),
        "quick": quick,
        "batch": BATCH,
        "zipf_s": ZIPF_S,
        "repeats": repeats,
        "warmup_steps": warmup,
        "steps": steps,
    }
    with tempfile.TemporaryDirectory(prefix="bench-tier-") as d:
        tmp = Path(d)
        if only in (None, "zipf"):
            res["zipf_part"] = zipf_runs(n_zipf, steps, warmup, repeats, tmp)
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
    parser.add_argument(
        "--warmup",
        type=int,
        metavar="STEPS",
        help="Zipf steps before timing (default 600: LFU's hit rate climbs that long)",
    )
    args = parser.parse_args()
    main(args.quick, args.only, args.warmup)
