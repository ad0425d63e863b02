"""The serving benchmark's ``freshness`` part: push-acknowledged to visible-on-the-follower
lag under a training load; skipped while ``ps-server`` has no ``--follow``.
``bench_serving.py`` runs it; see its docstring.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: client/, worker/
sys.path.insert(1, str(Path(__file__).resolve().parent))  # serving_parts, beside this file

from serving_parts import (  # noqa: E402
    BENCH,
    DIM,
    FRESHNESS_GOAL_S,
    LOAD_BATCH,
    LOAD_TABLE,
    MARKER_TABLE,
    SHARDS,
    Processes,
    Setup,
    ps_server_help,
)

from client import PSClient  # noqa: E402

# -- part 3: freshness ---------------------------------------------------------------------


def train_load(addresses: list[str], rows: int, out: Path) -> None:
    """The training load (a child process): push ``LOAD_BATCH``-key batches of ``LOAD_TABLE`` as
    fast as the shards take them until SIGTERM; then write what it did to ``out``."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng = np.random.default_rng(11)
    grads = (rng.standard_normal((LOAD_BATCH, DIM)) * 1e-3).astype(np.float32)
    pushes, t0 = 0, time.perf_counter()
    with PSClient(addresses) as client:
        while not stop.is_set():
            client.push(LOAD_TABLE, rng.integers(0, rows, LOAD_BATCH), grads)
            pushes += 1
    wall = time.perf_counter() - t0
    out.write_text(
        json.dumps(
            {"pushes": pushes, "seconds": wall, "pushes_per_s": pushes / wall, "keys_per_s": pushes * LOAD_BATCH / wall}
        )
    )


def wait_following(addresses: list[str], timeout_s: float = 120.0) -> None:
    """Until every follower's stream is connected and it holds ``MARKER_TABLE``."""
    deadline = time.monotonic() + timeout_s
    with PSClient(addresses) as client:
        while True:
            stats = client.admin.stats()
            if all(s["follow"]["connected"] and MARKER_TABLE in {t["name"] for t in s["tables"]} for s in stats):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"followers not following after {timeout_s} s: {[s['follow'] for s in stats]}")
            time.sleep(0.1)


def lag_samples(leader: PSClient, follower: PSClient, first: int, n: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """``n`` samples: push marker value v (a new key each) to the training shards; from the ack,
    look the key up on the followers until it reads v (zeros init, SGD lr 1, grad -v)."""
    rng = np.random.default_rng(first)
    lags, polls, timeouts = [], [], 0
    for v in range(first, first + n):
        key = np.array([(1 << 40) + v], np.int64)
        leader.push(MARKER_TABLE, key, np.full((1, DIM), -float(v), np.float32))
        acked = time.perf_counter()
        count = 0
        while True:
            row = follower.lookup(MARKER_TABLE, key)
            count += 1
            now = time.perf_counter()
            if row[0, 0] == v:
                lags.append(now - acked)
                polls.append((now - acked) / count)
                break
            if now - acked > timeout_s:
                timeouts += 1
                break
        time.sleep(rng.uniform(0, 0.02))  # spread samples over the follower's batch cadence
    ms = 1e3 * np.asarray(lags or [np.nan])
    return {
        "samples": len(lags),
        "timeouts": timeouts,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "poll_interval_ms": 1e3 * float(np.median(polls)) if polls else None,
    }


def freshness_part(setup: Setup, procs: Processes) -> dict[str, Any]:
    """Lag from a push's acknowledgement to the row on a ``--follow`` serving shard; idle and
    under a training load (a separate process pushing as fast as the shards take it)."""
    if "--follow" not in ps_server_help():
        return {"skipped": "ps-server has no --follow yet"}
    root = setup.tmp / "freshness"
    train = [
        procs.shard(i, SHARDS, root / "train", "--data-dir=" + str(root / "train" / "data-{shard}"))
        for i in range(SHARDS)
    ]
    leaders = [s.address for s in train]
    with PSClient(leaders) as c:
        c.create_table(LOAD_TABLE, DIM, optimizer="adagrad")
        c.create_table(MARKER_TABLE, DIM, optimizer="sgd", initializer="zeros", lr=1.0)
    followers = [
        procs.shard(i, SHARDS, root / "serve", "--mode=serve", f"--follow={leaders[i]}").address for i in range(SHARDS)
    ]
    wait_following(followers)
    idle_n, load_n = (10, 30) if setup.quick else (50, 300)
    print(f"freshness: {idle_n} markers idle, then {load_n} under a training load ...", file=sys.stderr)
    load_out = root / "load.json"
    with PSClient(leaders) as leader, PSClient(followers) as follower:
        # Warm-up: a shard's first lookup and a channel's first call cost ~0.2 s; touch every shard first.
        warm = np.arange(64, dtype=np.int64) + (1 << 41)
        leader.push(MARKER_TABLE, warm, np.ones((len(warm), DIM), np.float32))
        follower.lookup(MARKER_TABLE, warm)
        lag_samples(leader, follower, 1, 2)
        idle = lag_samples(leader, follower, 3, idle_n)
        load = procs.popen(
            [
                sys.executable,
                str(BENCH),
                "--train-load",
                "--addresses",
                ",".join(leaders),
                "--rows",
                str(setup.rows),
                "--out",
                str(load_out),
            ],
            root / "load.log",
        )
        time.sleep(1.0)  # the load is under way (its imports done, pushes flowing)
        loaded = lag_samples(leader, follower, 3 + idle_n, load_n)
        follow_stats = [s["follow"] for s in follower.admin.stats()]
        if procs.stop(load) != 0 or not load_out.exists():
            raise RuntimeError(f"training load failed:\n{(root / 'load.log').read_text(errors='replace')[-3000:]}")
    load_stats = json.loads(load_out.read_text())
    lines = [
        "push acknowledged -> row visible on the --follow shard (polled by lookups), 2 training shards "
        "each followed by one"
    ]
    for name, x in (("idle", idle), ("under training load", loaded)):
        lines.append(
            f"  {name}: p50 {x['p50_ms']:.1f} ms, p99 {x['p99_ms']:.1f} ms, max {x['max_ms']:.1f} ms "
            f"({x['samples']} samples, {x['timeouts']} timeouts; a poll every "
            f"{x['poll_interval_ms'] or 0:.2f} ms)"
        )
    ok = loaded["p99_ms"] <= 1e3 * FRESHNESS_GOAL_S and not loaded["timeouts"]
    goal = {
        "goal": "p99 lag under training load",
        "value_ms": loaded["p99_ms"],
        "target": f"<= {FRESHNESS_GOAL_S:g} s, no timeouts",
        "pass": ok,
    }
    lines.append(f"  goal: p99 lag under training load {loaded['p99_ms']:.1f} ms (target {goal['target']}): {ok}")
    lines.append(
        f"  training load: {load_stats['pushes_per_s']:.1f} pushes/s of {LOAD_BATCH:,} keys x dim {DIM} "
        f"({load_stats['keys_per_s'] / 1e3:.0f}K keys/s)"
    )
    lines.append(
        "  the followers' own lag (Stats) once, under the load: "
        + ", ".join(f"{f['lag_versions']} versions / {f['lag_s']:.3f} s" for f in follow_stats)
    )
    return {
        "idle": idle,
        "under_load": loaded,
        "load": load_stats,
        "follow_stats": follow_stats,
        "goals": [goal],
        "report": lines,
    }
