"""What embedding health costs: Lookup and Push throughput of a shard with health on, beside
one with it off, in the same run (the foundation workloads P1 and P2).

Two ``ps-server`` processes on this machine, one with ``--health-window-s 1`` (its rows
scanned every second: sixty times the default's scans) and one with ``--health-window-s 0``
(health off), each holding a dim-64 Adagrad table of 1M resident rows. One client calls them
in turn, interleaved over many rounds so that drift of the machine falls on both alike:

* P1: Lookup of 65,536 resident keys;
* P2: Push of 65,536 gradients (Adagrad).

The goal: each health-on median within 3% of the health-off one (ratio >= 0.97). Beside
the RPC figures, the work health adds is timed in-process where noise cannot hide it: a
65,536-row push into a table with and without health, and one scan of the 1M resident rows.
Last, ``ps-admin drift`` (``deploy.drift``) between two checkpoints of a 2M-row dim-64 table on
two shards, over 1M sampled keys (goal: 10 s).

Usage: ``python benchmarks/bench_health.py [--quick]``; prints a table and writes
``benchmarks/results/health.json`` and ``health.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from client import PSClient  # noqa: E402
from ps.store import precision  # noqa: E402
from ps.table import OptimizerKind, OptimizerParams, Table, TableHealth, TableSpec  # noqa: E402

ROWS, DIM, RESIDENT, KEY_SETS, SEED = 65_536, 64, 1_000_000, 8, 1234
GOAL = 0.97
DRIFT_GOAL_S = 10.0
TABLE = "bench"
RESULTS = REPO / "benchmarks" / "results"


def start(tmp: Path, name: str, window_s: float) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp / f"{name}.port"
    cmd = [sys.executable, "-m", "ps", "--shard=0", "--num-shards=1", "--listen=127.0.0.1:0"]
    cmd += [f"--port-file={port_file}", f"--health-window-s={window_s}", "--grace-s=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp / f"{name}.log").open("wb"))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ps-server ({name}) did not start:\n{(tmp / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def rounds(ops: dict[str, Callable[[], object]], calls: int, n_rounds: int) -> dict[str, list[float]]:
    """``calls`` timed calls of each op, spread over ``n_rounds`` rounds that take the ops in turn."""
    for fn in ops.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in ops}
    per = max(1, calls // n_rounds)
    for r in range(n_rounds):
        order = list(ops.items()) if r % 2 == 0 else list(reversed(ops.items()))
        for name, fn in order:
            for _ in range(per):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return samples


def rpc_part(tmp: Path, calls: int, n_rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    resident = rng.integers(-(1 << 63), (1 << 63) - 1, size=RESIDENT, dtype=np.int64)
    sets = [rng.choice(resident, ROWS, replace=False) for _ in range(KEY_SETS)]
    grads = (rng.standard_normal((ROWS, DIM)) * 1e-3).astype(np.float32)
    procs = []
    try:
        clients = {}
        for name, window in (("on", 1.0), ("off", 0.0)):
            proc, address = start(tmp, name, window)
            procs.append(proc)
            client = PSClient([address]).start()
            client.create_table(TABLE, DIM, optimizer="adagrad")
            for chunk in np.array_split(resident, 16):
                client.lookup(TABLE, chunk)
            clients[name] = client
        out = np.empty((ROWS, DIM), np.float32)
        turn = iter(range(1 << 30))
        ops: dict[str, Callable[[], object]] = {}
        for name, client in clients.items():
            ops[f"lookup_{name}"] = lambda c=client: c.lookup(TABLE, sets[next(turn) % KEY_SETS], out=out)
            ops[f"push_{name}"] = lambda c=client: c.push(TABLE, sets[next(turn) % KEY_SETS], grads)
        samples = rounds(ops, calls, n_rounds)
        stats = clients["on"].admin.stats()[0]["tables"][0]
        for client in clients.values():
            client.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "medians_s": medians,
        "samples_s": samples,
        "lookup_ratio": medians["lookup_off"] / medians["lookup_on"],
        "push_ratio": medians["push_off"] / medians["push_on"],
        "health_seen": {
            "rows_touched": stats["rows_touched"],
            "row_norm_counted": sum(stats["row_norm"]["counts"]),
            "scanned": bool(stats["health_scanned_unix_s"]),
        },
    }


def in_process_part(repeats: int) -> dict[str, Any]:
    """A 65,536-row Adagrad push into a 1M-row table with and without health, and one scan."""
    rng = np.random.default_rng(SEED)
    keys = rng.integers(-(1 << 63), (1 << 63) - 1, size=RESIDENT, dtype=np.int64)
    batch = rng.choice(keys, ROWS, replace=False)
    grads = (rng.standard_normal((ROWS, DIM)) * 1e-3).astype(np.float32)
    spec = TableSpec(TABLE, dim=DIM, seed=1, optimizer=OptimizerParams(kind=OptimizerKind.ADAGRAD))
    tables = {"on": Table(spec, RESIDENT, health=True), "off": Table(spec, RESIDENT, health=False)}
    for t in tables.values():
        t.lookup(keys)
    times: dict[str, list[float]] = {k: [] for k in tables}
    for i in range(repeats):
        for name in tables if i % 2 == 0 else reversed(tables):
            t0 = time.perf_counter()
            tables[name].push(batch, grads, client_id="bench", seq=i + 1)
            times[name].append(time.perf_counter() - t0)
    # The work alone, many times over (the A/B above moves by a few % run to run): pick the
    # sample, read its rows before and after (two gathers of 16 rows of the 1M), count them.
    health, arena = TableHealth(), rng.standard_normal((RESIDENT, DIM)).astype(np.float32)
    slots = rng.choice(RESIDENT, ROWS, replace=False).astype(np.int32)
    t0, n = time.perf_counter(), 2000
    for _ in range(n):
        sample = health.sample(slots)
        health.pushed(
            precision.gather_float32(precision.FLOAT32, arena, sample),
            precision.gather_float32(precision.FLOAT32, arena, sample),
        )
    added = (time.perf_counter() - t0) / n
    scans = []
    for _ in range(5):
        t0 = time.perf_counter()
        tables["on"].scan_health(60.0)
        scans.append(time.perf_counter() - t0)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "push_on_s": on,
        "push_off_s": off,
        "push_added_s": on - off,
        "push_ratio": off / on,
        "health_work_per_push_s": added,
        "health_work_share_of_push": added / off,
        "scan_1m_rows_s": statistics.median(scans),
        "scan_share_of_default_window": statistics.median(scans) / 60.0,
    }


def drift_part(tmp: Path, rows: int, sample: int) -> dict[str, Any]:
    """``ps-admin drift`` over ``sample`` keys of a dim-64 table of ``rows`` rows on two shards,
    between a checkpoint and one taken after every row was pushed once more."""
    from deploy.drift import drift
    from deploy.operations import checkpoint_cluster

    rng = np.random.default_rng(SEED)
    keys = np.unique(rng.integers(-(1 << 63), (1 << 63) - 1, size=rows, dtype=np.int64))
    procs, addresses = [], []
    try:
        for i in range(2):
            port_file = tmp / f"drift-{i}.port"
            cmd = [sys.executable, "-m", "ps", f"--shard={i}", "--num-shards=2", "--listen=127.0.0.1:0"]
            cmd += [f"--port-file={port_file}", f"--data-dir={tmp / f'drift-{i}'}", "--grace-s=1"]
            procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("a drift shard did not start")
                time.sleep(0.05)
            addresses.append(f"127.0.0.1:{port_file.read_text().strip()}")
        with PSClient(addresses) as client:
            client.create_table(TABLE, DIM, optimizer="adagrad")
            for chunk in np.array_split(keys, max(1, rows // ROWS)):
                client.push(TABLE, chunk, (rng.standard_normal((len(chunk), DIM)) * 1e-2).astype(np.float32))
            first = checkpoint_cluster(addresses, "first")
            for chunk in np.array_split(keys, max(1, rows // ROWS)):
                client.push(TABLE, chunk, (rng.standard_normal((len(chunk), DIM)) * 1e-2).astype(np.float32))
            second = checkpoint_cluster(addresses, "second")
        t0 = time.perf_counter()
        report = drift([Path(p) for p in first["parts"]], [Path(p) for p in second["parts"]], TABLE, sample)
        seconds = time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    return {
        "rows": int(keys.shape[0]),
        "sample": sample,
        "compared": report.both,
        "seconds": seconds,
        "mean_cosine": report.mean_cosine,
        "goal_s": DRIFT_GOAL_S,
        "met": seconds <= DRIFT_GOAL_S,
    }


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = res["rpc"]["medians_s"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(2)
    ax.bar(x - 0.2, [ROWS / m["lookup_off"], ROWS / m["push_off"]], 0.4, label="health off")
    ax.bar(x + 0.2, [ROWS / m["lookup_on"], ROWS / m["push_on"]], 0.4, label="health on (scan every 1 s)")
    ax.set_xticks(x, ["P1 Lookup", "P2 Push (Adagrad)"])
    ax.set(ylabel="rows/s", title=f"Embedding health: on / off (goal >= {GOAL})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (~1 min)")
    args = ap.parse_args()
    calls, n_rounds, repeats = (40, 40, 20) if args.quick else (300, 300, 60)
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp:
        res: dict[str, Any] = {"rpc": rpc_part(Path(tmp), calls, n_rounds), "in_process": in_process_part(repeats)}
        res["drift"] = drift_part(Path(tmp), 200_000 if args.quick else 2_000_000, 100_000 if args.quick else 1_000_000)
    r, p = res["rpc"], res["in_process"]
    res["goals"] = {
        "lookup": {"got": r["lookup_ratio"], "goal": GOAL, "met": r["lookup_ratio"] >= GOAL},
        "push": {"got": r["push_ratio"], "goal": GOAL, "met": r["push_ratio"] >= GOAL},
        "drift_s": {"got": res["drift"]["seconds"], "goal": DRIFT_GOAL_S, "met": res["drift"]["met"]},
    }
    m = r["medians_s"]
    rows = [
        ("P1 Lookup 65,536 x 64", m["lookup_off"], m["lookup_on"], r["lookup_ratio"]),
        ("P2 Push 65,536 x 64 Adagrad", m["push_off"], m["push_on"], r["push_ratio"]),
        ("in-process push (no RPC)", p["push_off_s"], p["push_on_s"], p["push_ratio"]),
    ]
    print(f"{'workload':32} {'off ms':>9} {'on ms':>9} {'on/off thr':>11}  goal >= {GOAL}")
    for name, off, on, ratio in rows:
        print(f"{name:32} {off * 1e3:9.2f} {on * 1e3:9.2f} {ratio:11.3f}")
    print(
        f"health's own work per push: {p['health_work_per_push_s'] * 1e6:.0f} us "
        f"({p['health_work_share_of_push'] * 100:.2f}% of the in-process push)"
    )
    print(
        f"scan of 1M resident rows: {p['scan_1m_rows_s'] * 1e3:.1f} ms "
        f"({p['scan_share_of_default_window'] * 100:.3f}% of a core at the default 60 s window)"
    )
    print(f"health seen on the shard: {r['health_seen']}")
    d = res["drift"]
    print(
        f"ps-admin drift over {d['compared']:,} sampled keys of {d['rows']:,} rows x {DIM}: {d['seconds']:.2f} s "
        f"(goal <= {DRIFT_GOAL_S:.0f} s)"
    )
    if args.quick:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "health.json").write_text(json.dumps(res, indent=2))
    chart(res, RESULTS / "health.png")
    print(f"wrote {RESULTS / 'health.json'} and health.png")


if __name__ == "__main__":
    main()
