"""Live resharding benchmark: how fast rows move, and what training keeps of its speed meanwhile.

One run on real ``ps-server`` processes (127.0.0.1, data dirs, ``interval:5``):
1. Load: two shards get ``--rows`` rows of a dim-16 Adagrad table (lookups create them).
2. Peers: the raw Lookup throughput of those rows through the same client (every row read
   once, in ``--chunk``-key calls), and the floor of a durable move: writing the same
   number of whole rows (values, state, metadata) to RocksDB through this project's storage
   layer, in this process (a new owner writes each row it gets before it counts on it).
3. Idle move: a third shard is started and ``deploy.scale`` grows the cluster 2 -> 3 with
   nothing else running: rows/s and MB/s moved, bytes against the jump-hash expectation
   (a third of the rows, whole, with their keys). Then it shrinks back 3 -> 2.
4. Training: a trainer (lookup + push of ``--batch`` keys drawn from the rows, one step
   after another) runs for ``--steady-s`` (steady), then through a 2 -> 3 move as fast as
   it goes, then (after shrinking back) through one paced with ``max_rows_per_s`` at a
   quarter of the idle move's speed: samples/s during each against steady, slowest step.

Goals (issue 28): move rows/s >= 0.5x the peer's lookup rows/s; samples/s during a move
>= 0.7x steady; bytes within 10% of the expectation. Every figure is printed with its peer;
the machine is shared, so compare only ratios of one run.

Usage: ``python benchmarks/bench_reshard.py [--quick] [--rows N]`` ->
``benchmarks/results/reshard.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from client import ClientConfig, PSClient  # noqa: E402
from deploy.local import start_shard, stop_shard  # noqa: E402
from deploy.operations import GrpcShards  # noqa: E402
from deploy.scale import scale  # noqa: E402
from protos.keys import shard_of  # noqa: E402
from ps.store import (  # noqa: E402
    RowFormat,
    Rows,
    Storage,  # noqa: E402
)

DIM = 16
ROW_BYTES = 8 + 4 * (DIM + DIM + 2)  # key, values, Adagrad state, last access, use count: what moves per row
GOALS = {"move_vs_lookup": 0.5, "training_during_move": 0.7, "bytes_vs_expected": 0.10}
CONFIG = ClientConfig(deadline_s=120.0, backoff_initial_s=0.005, backoff_max_s=0.1)


class Trainer:
    """Lookup + push of ``batch`` random keys of ``keys`` per step, timing each step."""

    def __init__(self, client: PSClient, keys: np.ndarray, batch: int) -> None:
        self.client, self.keys, self.batch = client, keys, batch
        self.steps: list[tuple[float, float]] = []  # (end time, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Trainer:
        self._thread.start()
        return self

    def _run(self) -> None:
        rng = np.random.default_rng(5)
        grads = np.full((self.batch, DIM), 1e-3, np.float32)
        try:
            while not self._stop.is_set():
                keys = self.keys[rng.integers(0, self.keys.size, self.batch)]
                t0 = time.perf_counter()
                self.client.lookup("emb", keys)
                self.client.push("emb", keys, grads)
                self.steps.append((time.perf_counter(), time.perf_counter() - t0))
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)
        if self.error is not None:
            raise RuntimeError(f"the trainer failed: {self.error!r}")

    def between(self, t0: float, t1: float) -> dict[str, float]:
        inside = [s for end, s in self.steps if t0 <= end <= t1]
        if not inside:
            return {"steps": 0, "samples_per_s": 0.0, "slowest_step_s": 0.0, "median_step_s": 0.0}
        return {
            "steps": len(inside),
            "samples_per_s": len(inside) * self.batch / (t1 - t0),
            "slowest_step_s": max(inside),
            "median_step_s": float(np.median(inside)),
        }


def write_floor(n: int, root: Path) -> float:
    """Rows/s writing ``n`` whole rows to RocksDB as a new owner does (8,192 a batch)."""
    keys = np.random.default_rng(1).integers(0, 2**62, n)
    rows = Rows(
        keys,
        np.ones((n, DIM), np.float32),
        np.ones((n, DIM), np.float32),
        np.zeros(n, np.uint32),
        np.zeros(n, np.uint32),
    )
    with Storage(root / "floor", shard=0, num_shards=1) as st:
        table = st.table("t", RowFormat(DIM, DIM))
        t0 = time.perf_counter()
        for start in range(0, n, 8192):
            batch = st.batch()
            table.put(batch, rows[start : start + 8192])
            st.commit(batch)
        return n / (time.perf_counter() - t0)


def move(shards: list[Any], n: int, **kw: Any) -> tuple[Any, float, float]:
    """``deploy.scale`` from the first ``n`` shards to all of ``shards`` (or back); ``(report, t0, t1)``."""
    calls = GrpcShards(120.0)
    try:
        t0 = time.perf_counter()
        report = scale(calls, [s.address for s in shards[:n]], [s.address for s in shards], **kw)
        return report, t0, time.perf_counter()
    finally:
        calls.close()


def shrink(shards: list[Any], n: int) -> None:
    """Back from ``shards`` to their first ``n`` (waiting for the last move to settle)."""
    calls = GrpcShards(120.0)
    try:
        scale(calls, [s.address for s in shards], [s.address for s in shards[:n]])
    finally:
        calls.close()


def run(rows: int, chunk: int, batch: int, steady_s: float, root: Path) -> dict[str, Any]:
    args = ("--data-dir={root}/data-{shard}", "--durability=interval:5", "--reshard-settle-s=1")
    shard_args = tuple(a.replace("{root}", str(root)) for a in args)
    shards = [start_shard(i, 2, root, *shard_args) for i in range(2)]
    try:
        keys = (np.arange(rows, dtype=np.int64) * 2654435761) ^ 0x5DEECE66D
        expected = int((shard_of(keys, 3) == 2).sum())
        with PSClient([s.address for s in shards], CONFIG) as client:
            client.create_table("emb", DIM, optimizer="adagrad", lr=0.01, seed=3)
            t0 = time.perf_counter()
            for start in range(0, rows, chunk):
                client.lookup("emb", keys[start : start + chunk])
            load_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for start in range(0, rows, chunk):  # the peer: every row read once more
                client.lookup("emb", keys[start : start + chunk])
            lookup_s = time.perf_counter() - t0
        floor = write_floor(expected, root)
        time.sleep(6.0)  # the interval flush writes the loaded rows: the move reads a settled shard
        shards.append(start_shard(2, 3, root, *shard_args))
        idle, t0, t1 = move(shards, 2)
        idle_s = t1 - t0
        shrink(shards, 2)
        trainer_client = PSClient([s.address for s in shards[:2]], CONFIG).start()
        trainer = Trainer(trainer_client, keys, batch).start()
        time.sleep(1.0)  # warm
        steady_t0 = time.perf_counter()
        time.sleep(steady_s)
        steady_t1 = time.perf_counter()
        busy, busy_t0, busy_t1 = move(shards, 2)
        time.sleep(1.0)
        shrink(shards, 2)
        pace = max(1000.0, idle.rows_moved / idle_s / 4 / 2)  # a quarter of the idle speed, per copy (2 of them)
        paced, paced_t0, paced_t1 = move(shards, 2, max_rows_per_s=pace)
        time.sleep(1.0)
        trainer.stop()
        trainer_client.close()
        return {
            "rows": rows,
            "dim": DIM,
            "row_bytes": ROW_BYTES,
            "load_s": load_s,
            "lookup": {"seconds": lookup_s, "rows_per_s": rows / lookup_s, "mb_per_s": rows * 4 * DIM / lookup_s / 1e6},
            "write_floor_rows_per_s": floor,
            "move": {
                "seconds": idle_s,
                "phases_s": idle.seconds,
                "rows_moved": idle.rows_moved,
                "rows_expected": expected,
                "bytes_moved": idle.bytes_received,
                "bytes_expected": expected * ROW_BYTES,
                "rows_per_s": idle.rows_moved / idle_s,
                "mb_per_s": idle.bytes_received / idle_s / 1e6,
            },
            "training": {
                "batch": batch,
                "steady": trainer.between(steady_t0, steady_t1),
                "during_move": trainer.between(busy_t0, busy_t1)
                | {"move_s": busy_t1 - busy_t0, "rows_sent": busy.rows_sent},
                "during_paced_move": trainer.between(paced_t0, paced_t1)
                | {"move_s": paced_t1 - paced_t0, "rows_sent": paced.rows_sent, "max_rows_per_s_per_copy": pace},
            },
        }
    finally:
        for shard in shards:
            if shard.proc.poll() is None:
                stop_shard(shard, 120)


def ratios(res: dict[str, Any]) -> dict[str, float]:
    move, lookup, training = res["move"], res["lookup"], res["training"]
    steady = max(1e-9, training["steady"]["samples_per_s"])
    return {
        "move_vs_lookup": move["rows_per_s"] / lookup["rows_per_s"],
        "move_vs_write_floor": move["rows_per_s"] / res["write_floor_rows_per_s"],
        "training_during_move": training["during_move"]["samples_per_s"] / steady,
        "training_during_paced_move": training["during_paced_move"]["samples_per_s"] / steady,
        "bytes_vs_expected": abs(move["bytes_moved"] - move["bytes_expected"]) / move["bytes_expected"],
    }


def table(res: dict[str, Any]) -> str:
    r, move, lookup, tr = ratios(res), res["move"], res["lookup"], res["training"]
    paced = tr["during_paced_move"]
    lines = [
        f"live reshard 2 -> 3 shards of {res['rows']:,} rows (dim {DIM}, Adagrad: {ROW_BYTES} B a row with its key)",
        "| figure | ours | peer | ratio | goal |",
        "|---|---|---|---|---|",
        f"| move rows/s (idle) | {move['rows_per_s']:,.0f} ({move['mb_per_s']:.1f} MB/s) | lookup {lookup['rows_per_s']:,.0f} "
        f"| {r['move_vs_lookup']:.2f} | >= {GOALS['move_vs_lookup']} |",
        f"| move rows/s (idle) | {move['rows_per_s']:,.0f} | durable-write floor {res['write_floor_rows_per_s']:,.0f} "
        f"| {r['move_vs_write_floor']:.2f} | |",
        f"| bytes moved (idle) | {move['bytes_moved'] / 1e6:.1f} MB | expected {move['bytes_expected'] / 1e6:.1f} MB "
        f"| off by {r['bytes_vs_expected']:.1%} | <= {GOALS['bytes_vs_expected']:.0%} |",
        f"| training samples/s during a move | {tr['during_move']['samples_per_s']:,.0f} | steady "
        f"{tr['steady']['samples_per_s']:,.0f} | {r['training_during_move']:.2f} | >= {GOALS['training_during_move']} |",
        f"| ... during a move paced at {paced['max_rows_per_s_per_copy']:,.0f} rows/s a copy | "
        f"{paced['samples_per_s']:,.0f} | steady {tr['steady']['samples_per_s']:,.0f} | "
        f"{r['training_during_paced_move']:.2f} | >= {GOALS['training_during_move']} |",
        f"| slowest training step during the move / paced move | {tr['during_move']['slowest_step_s'] * 1000:.0f} / "
        f"{paced['slowest_step_s'] * 1000:.0f} ms | median steady {tr['steady']['median_step_s'] * 1000:.0f} ms | | |",
        f"idle phases (s): {', '.join(f'{k} {v:.2f}' for k, v in move['phases_s'].items())}; rows moved "
        f"{move['rows_moved']:,} of {move['rows_expected']:,} expected; moves under training took "
        f"{tr['during_move']['move_s']:.1f} s and {paced['move_s']:.1f} s (paced)",
    ]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart; pip install '.[bench]')")
        return
    r = ratios(res)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    names = [
        "move rows/s\n/ lookup rows/s",
        "move rows/s\n/ write floor",
        "samples/s in move\n/ steady",
        "... paced move",
    ]
    values = [r["move_vs_lookup"], r["move_vs_write_floor"], r["training_during_move"], r["training_during_paced_move"]]
    goals = [GOALS["move_vs_lookup"], 1.0, GOALS["training_during_move"], GOALS["training_during_move"]]
    bars = ax.bar(names, values, color=["tab:blue", "tab:cyan", "tab:green", "tab:olive"])
    for bar, goal in zip(bars, goals):
        ax.hlines(goal, bar.get_x(), bar.get_x() + bar.get_width(), colors="red", linestyles="dashed")
    ax.set_ylabel("ratio (red: goal)")
    ax.set_title(f"live reshard 2 -> 3, {res['rows']:,} rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300,000 rows, short phases")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--chunk", type=int, default=1 << 17, help="keys per lookup call (load and peer)")
    parser.add_argument("--batch", type=int, default=8192, help="keys per training step")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    rows = 300_000 if args.quick else args.rows
    steady_s = 3.0 if args.quick else args.steady_s
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as tmp:
        res = run(rows, args.chunk, args.batch, steady_s, Path(tmp))
    res["ratios"] = ratios(res)
    res["goals"] = GOALS
    res["passed"] = {
        "move_vs_lookup": res["ratios"]["move_vs_lookup"] >= GOALS["move_vs_lookup"],
        "training_during_move": res["ratios"]["training_during_move"] >= GOALS["training_during_move"],
        "training_during_paced_move": res["ratios"]["training_during_paced_move"] >= GOALS["training_during_move"],
        "bytes_vs_expected": res["ratios"]["bytes_vs_expected"] <= GOALS["bytes_vs_expected"],
    }
    res["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    print(table(res))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reshard.json").write_text(json.dumps(res, indent=2, sort_keys=True))
    plot(res, args.out / "reshard.png")
    print(f"wrote {args.out / 'reshard.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
