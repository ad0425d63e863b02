"""Part 1 of bench_tier.py: Zipf(1.05) training traffic against a shard whose memory
budget holds 10% of the rows, next to the same traffic with every row in RAM, and next
to the RocksDB I/O that the faults and spills need, done raw.

Every batch of keys and the gradients are drawn before any timing, and each run replays
the same ones: the timed loop is lookups and pushes only. A step looks up a batch of
``BATCH`` Zipf draws (deduplicated) and pushes a gradient for each of its rows (dim 16,
Adagrad). Runs alternate (all-RAM, tier, ...) and repeat; the report takes medians,
because this machine is shared and its speed drifts between runs.

The I/O floor: a raw rocksdict database of the same rows (same column-family options as
the tier) does, per step, one multi-get of as many random stored keys as the tier faulted
in and one write batch of as many rows as it spilled, single-threaded. No
design that keeps these rows in this RocksDB through rocksdict does less work per step,
which bounds the ratio: ``ram / (ram + io)`` if the I/O does not overlap anything, and
``ram / (ram + io / cores)`` if it were spread perfectly over every core.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import rocksdict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from ps.durability import Durability  # noqa: E402
from ps.shard import Shard  # noqa: E402
from ps.store import Storage, table_options  # noqa: E402
from ps.table import (  # noqa: E402
    Eviction,  # noqa: E402
    OptimizerKind,
    OptimizerParams,
    Table,  # noqa: E402
    TableSpec,  # noqa: E402
)

BATCH = 16_384  # Zipf draws per step (before dedup)
ZIPF_S = 1.05
BUDGET_FRACTION = 0.10
DIM = 16


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


def budget_for(n: int) -> int:
    return int(BUDGET_FRACTION * n * Table(adagrad_spec(DIM)).bytes_per_row)


class Workload:
    """The keys, batches and gradients of every run, drawn once."""

    def __init__(self, n: int, steps: int, warmup: int) -> None:
        zipf = Zipf(n, ZIPF_S, seed=11)
        self.n, self.steps, self.warmup = n, steps, warmup
        self.keys = zipf.keys  # most popular first
        self.batches = [zipf.batch(BATCH) for _ in range(warmup + steps)]
        self.grads = np.random.default_rng(5).standard_normal((BATCH, DIM), dtype=np.float32) * np.float32(0.01)


def mode_name(mode: str | None) -> str:
    """``mode``: None (every row in RAM), or a durability, then ``/lru`` for LRU eviction
    instead of the default LFU."""
    if mode is None:
        return "all in RAM"
    durability, eviction = split_mode(mode)
    return f"budget 10%, {durability}" + (", LRU" if eviction == "lru" else "")


def split_mode(mode: str) -> tuple[str, Eviction]:
    durability, _, eviction = mode.partition("/")
    return durability, cast(Eviction, eviction or "lfu")


WARMUP_WINDOW = 100  # steps per hit-rate sample while warming up


def _hit_rate(c0: dict[str, int], c1: dict[str, int]) -> float:
    hits, misses = c1.get("ram_hits", 0) - c0.get("ram_hits", 0), c1.get("ram_misses", 0) - c0.get("ram_misses", 0)
    return hits / max(hits + misses, 1) if hits + misses else 1.0


def _warm_up(
    work: Workload, step: Callable[[int, npt.NDArray[np.int64]], None], counters: Callable[[], dict[str, int]]
) -> list[float]:
    """Run the warm-up steps; the RAM hit rate of every ``WARMUP_WINDOW`` of them (LFU
    learns which rows are popular from their counts: its hit rate climbs for ~600 steps)."""
    curve = []
    c0 = counters()
    for seq, keys in enumerate(work.batches[: work.warmup], 1):
        step(seq, keys)
        if seq % WARMUP_WINDOW == 0 or seq == work.warmup:
            c1 = counters()
            curve.append(round(_hit_rate(c0, c1), 4))
            c0 = c1
    return curve


def _result(work: Workload, mode: str | None, elapsed: float, c0: dict[str, int], c1: dict[str, int]) -> dict[str, Any]:
    rows = sum(b.shape[0] for b in work.batches[work.warmup :])
    per_step = {k: (c1.get(k, 0) - c0.get(k, 0)) / work.steps for k in ("rows_faulted_in", "rows_spilled")}
    return {
        "mode": mode_name(mode),
        "rows": work.n,
        "unique_keys_per_step": rows / work.steps,
        "rows_per_s": 2 * rows / elapsed,  # each key is looked up and pushed
        "step_ms": 1e3 * elapsed / work.steps,
        "ram_hit_rate": _hit_rate(c0, c1) if mode else 1.0,
        "faulted_in_per_step": per_step["rows_faulted_in"],
        "spilled_per_step": per_step["rows_spilled"],
        "written_per_step": (c1.get("rows_written", 0) - c0.get("rows_written", 0)) / work.steps,
    }


def in_process(work: Workload, mode: str | None, tmp: Path) -> dict[str, Any]:
    """The shard's own code, no transport (``mode``: see ``mode_name``)."""
    spec = adagrad_spec(DIM)
    data_dir = tmp / "zipf-data"
    if mode is None:
        shard = Shard(0, 1)
    else:
        durability, eviction = split_mode(mode)
        storage = Storage(data_dir, shard=0, num_shards=1)
        shard = Shard(0, 1, storage, Durability.parse(durability), budget_for(work.n), eviction=eviction)
    shard.create_table(spec)
    table = shard.table("t")
    shard.start()
    for start in range(0, work.n, 1 << 16):
        table.lookup(work.keys[start : start + (1 << 16)])
        shard.budget.after_request()

    def step(seq: int, keys: npt.NDArray[np.int64]) -> None:
        table.lookup(keys)
        shard.budget.after_request()
        table.push(keys, work.grads[: keys.shape[0]], client_id="bench", seq=seq)
        shard.budget.after_request()

    warmup = _warm_up(work, step, lambda: dict(vars(table.counters)))
    c0 = dict(vars(table.counters))
    t0 = time.perf_counter()
    for seq, keys in enumerate(work.batches[work.warmup :], work.warmup + 1):
        step(seq, keys)
    elapsed = time.perf_counter() - t0
    out = _result(work, mode, elapsed, c0, dict(vars(table.counters)))
    out["warmup_hit_rates"] = warmup
    shard.close()
    shard.shutdown()
    shutil.rmtree(data_dir, ignore_errors=True)
    return out


def served(work: Workload, mode: str | None, tmp: Path) -> dict[str, Any]:
    """End to end: a real ``ps-server`` process and a ``PSClient`` over loopback gRPC."""
    from client import PSClient
    from deploy.local import start_shard, stop_shard

    root = tmp / "served"
    args = []
    if mode is not None:
        durability, eviction = split_mode(mode)
        args = [
            f"--data-dir={root / 'data'}",
            f"--memory-budget-bytes={budget_for(work.n)}",
            f"--durability={durability}",
            f"--eviction={eviction}",
        ]
    shard = start_shard(0, 1, root, *args)
    try:
        with PSClient([shard.address]) as client:
            client.create_table("t", DIM, optimizer="adagrad", lr=0.05, seed=3)
            for start in range(0, work.n, 1 << 16):
                client.lookup("t", work.keys[start : start + (1 << 16)])

            def step(_: int, keys: npt.NDArray[np.int64]) -> None:
                client.lookup("t", keys)
                client.push("t", keys, work.grads[: keys.shape[0]])

            warmup = _warm_up(work, step, lambda: cast(dict[str, int], client.admin.stats()[0]["tables"][0]))
            c0 = client.admin.stats()[0]["tables"][0]
            t0 = time.perf_counter()
            for seq, keys in enumerate(work.batches[work.warmup :], work.warmup + 1):
                step(seq, keys)
            elapsed = time.perf_counter() - t0
            c1 = client.admin.stats()[0]["tables"][0]
    finally:
        stop_shard(shard)
        shutil.rmtree(root, ignore_errors=True)
    out = _result(work, mode, elapsed, c0, c1)
    out["mode"] += " (gRPC)"
    out["warmup_hit_rates"] = warmup
    return out


def io_floor(n: int, reads: int, writes: int, steps: int, tmp: Path) -> dict[str, float]:
    """ms per step of raw rocksdict I/O: a multi-get of ``reads`` random stored keys and a
    write batch of ``writes`` rows, on ``n`` stored rows of the tier's record size."""
    opts = table_options()
    opts.create_if_missing(True)
    opts.set_allow_mmap_reads(True)
    path = tmp / "io-floor"
    db = rocksdict.Rdict(str(path), opts)
    keys = key_space(n).astype(">i8").view("V8")
    record = 4 * (2 * DIM + 2)  # values, Adagrad state, access time, count
    values = (
        np.random.default_rng(1).random((1 << 16, record // 4), dtype=np.float32).view(f"V{record}").ravel().tolist()
    )
    for start in range(0, n, 1 << 16):
        batch = rocksdict.WriteBatch(raw_mode=True)
        for k, v in zip(keys[start : start + (1 << 16)].tolist(), values, strict=False):
            batch.put(k, v)
        db.write(batch)
    db.flush()
    db.compact_range(None, None)
    rng = np.random.default_rng(2)
    read_s = write_s = 0.0
    for _ in range(steps):
        want = keys[np.sort(rng.choice(n, reads, replace=False))].tolist()
        t0 = time.perf_counter()
        got = db.get(want)
        read_s += time.perf_counter() - t0
        assert got[0] is not None
        put = keys[np.sort(rng.choice(n, writes, replace=False))].tolist()
        t0 = time.perf_counter()
        batch = rocksdict.WriteBatch(raw_mode=True)
        for k, v in zip(put, values, strict=False):
            batch.put(k, v)
        db.write(batch)
        write_s += time.perf_counter() - t0
    # Can this I/O overlap the shard's Python work (request handling, gRPC)? Only while it
    # runs without the GIL: a Python loop beside it stalls when it does not.
    reads_of = [keys[np.sort(rng.choice(n, reads, replace=False))].tolist() for _ in range(steps // 4)]
    batches = []
    for _ in range(steps // 4):
        batch = rocksdict.WriteBatch(raw_mode=True)
        for k, v in zip(keys[np.sort(rng.choice(n, writes, replace=False))].tolist(), values, strict=False):
            batch.put(k, v)
        batches.append(batch)
    get, write = db.get, db.write
    read_stall = python_stalled_beside(lambda: [get(w) for w in reads_of])
    write_stall = python_stalled_beside(lambda: [write(b) for b in batches])
    db.close()
    del db
    shutil.rmtree(path, ignore_errors=True)
    return {
        "read_ms": 1e3 * read_s / steps,
        "write_ms": 1e3 * write_s / steps,
        "cores": float(os.cpu_count() or 1),
        "python_stalled_beside_read": read_stall,
        "python_stalled_beside_write": write_stall,
    }


def python_stalled_beside(work: Callable[[], object]) -> float:
    """Share of the time a Python loop is stalled (no iteration for over 0.5 ms) while
    ``work`` runs on another thread: near 0 when ``work`` releases the GIL and a core is
    free, near the share of time inside ``work``'s calls when those hold the GIL."""
    other = threading.Thread(target=work)
    stalled, t0 = 0.0, time.perf_counter()
    last = t0
    other.start()
    while other.is_alive():
        now = time.perf_counter()
        if now - last > 5e-4:
            stalled += now - last
        last = now
    return stalled / (time.perf_counter() - t0)
