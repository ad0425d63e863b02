"""Foundation benchmark: is one shard as fast and as lean as this machine and gRPC Python allow?

Per call 65,536 unique keys x dim 64 float32, on loopback. One run measures:
1. Ceiling: a raw-bytes gRPC server (this script, ``--echo-server``): ``Lookup`` returns a prebuilt
   ``bytes`` as long as our real ``LookupResponse`` (~16 MiB), ``Push`` takes one as long as our real
   ``PushRequest`` (~16.5 MiB); identity (de)serializers, ``ps-server``'s message limits and
   ``tune_malloc()``. No code of ours touches the bytes: this is gRPC Python's transport alone, which
   no server on this transport can beat, hence the yardstick for the ratios.
2. Ours: a real ``python -m ps`` shard (dim-64 Adagrad table, 1M rows) via ``PSClient.lookup(out=)``
   and ``PSClient.push``; same message bytes, so a ratio is a latency ratio. Client processes with
   default and with tuned malloc; ceiling and ours interleaved in rounds (the machine is shared);
   a breakdown of the client's steps and of the server's handlers (run in-process).
3. Memory per row: RSS growth of a fresh process inserting N keys into a dim-16 Adagrad ``Table``
   (128 B of values + state per row): what the index, metadata and growth slack add.
4. Ready time: ``Popen`` to port file, numba cache cold (fresh ``NUMBA_CACHE_DIR``) once, then warm;
   and the first lookup+push after ready, where the kernels compile or load (lazily).
Usage: ``python benchmarks/bench_foundation.py [--quick]`` -> ``benchmarks/results/foundation.{json,png}``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import grpc
import numba
import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # headlines and serving_floor, beside this file

from headlines import FOUNDATION_GOALS as GOALS  # noqa: E402
from headlines import FOUNDATION_MEMORY_OVER_BYTES as OVER_BYTES  # noqa: E402
from headlines import FOUNDATION_READY_S as READY_S  # noqa: E402
from serving_floor import serve_raw  # noqa: E402

from client import ClientConfig, GrpcTransport, PSClient  # noqa: E402
from client.batching import scatter_rows  # noqa: E402
from client.routing import pack, plan_table  # noqa: E402
from protos import ps_pb2 as pb  # noqa: E402
from protos import wire  # noqa: E402
from protos.wire import tune_malloc  # noqa: E402
from ps.service import Servicer  # noqa: E402
from ps.shard import Shard  # noqa: E402
from ps.table import (  # noqa: E402
    OptimizerKind,
    OptimizerParams,
    Table,  # noqa: E402
    TableSpec,  # noqa: E402
)

ROWS, DIM, MAX_MSG, RESIDENT = 65_536, 64, 64 << 20, 1_000_000
TABLE, ECHO_SERVICE, SEED, KEY_SETS = "bench", "bench.Echo", 1234, 8
RESULTS = REPO / "benchmarks" / "results"
PS_CMD = [sys.executable, "-m", "ps", "--shard", "0", "--num-shards", "1", "--listen", "127.0.0.1:0", "--grace-s", "1"]
OPTIONS = [("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG)]
ADAGRAD = OptimizerParams(kind=OptimizerKind.ADAGRAD)
LOOKUP_BYTES = len(wire.LookupResponseWriter([(TABLE, ROWS, DIM, wire.FLOAT32)]).finish())
Keys = npt.NDArray[np.int64]
Samples = dict[str, list[float]]


def workload() -> tuple[Keys, list[Keys]]:
    """The 1M resident keys (random, so unique in practice), and ``KEY_SETS`` batches of unique ones among them."""
    resident = np.random.default_rng(SEED).integers(-(1 << 63), (1 << 63) - 1, size=RESIDENT, dtype=np.int64)
    rng = np.random.default_rng(SEED + 1)
    return resident, [rng.choice(resident, ROWS, replace=False) for _ in range(KEY_SETS)]


def lookup_request(keys: Keys) -> bytes:
    entry = pb.LookupEntry(table=TABLE, keys=wire.encode_keys(keys), dtype=pb.FLOAT32)
    return pb.LookupRequest(entries=[entry], num_shards=1, shard=0).SerializeToString()


def push_request(keys: Keys, grads: npt.NDArray[np.float32], client_id: str, seq: int) -> bytes:
    return wire.encode_push_request([(TABLE, keys, grads, wire.FLOAT32)], 1, client_id, seq, 0)


def rss_bytes(field: str = "VmRSS") -> int:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status[field].split()[0]) * 1024  # "123456 kB"


def run_rounds(ops: dict[str, Callable[[], object]], calls: int, warmup: int, rounds: int = 3) -> Samples:
    """Warm each op up, then time ``calls`` calls of each, interleaved in ``rounds``."""
    for fn in [fn for fn in ops.values() for _ in range(warmup)]:
        fn()
    samples: Samples = {k: [] for k in ops}
    for _ in range(rounds):
        for name, fn in ops.items():
            for _ in range(max(1, calls // rounds)):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return samples


def echo_server(port_file: Path) -> None:
    """The ceiling: raw bytes in, prebuilt raw bytes out."""
    tune_malloc()
    response = np.random.default_rng(0).bytes(LOOKUP_BYTES)
    push_reply = pb.PushResponse(applied=True, rows_updated=ROWS).SerializeToString()
    serve_raw(
        ECHO_SERVICE, {"Lookup": lambda req, ctx: response, "Push": lambda req, ctx: push_reply}, port_file, OPTIONS
    )


def memory_child(n: int) -> dict[str, Any]:
    """RSS growth per row of a dim-16 Adagrad table holding ``n`` keys (run in a fresh process)."""
    tune_malloc()  # as ps-server does
    # Load all kernels (tens of MB, once) first; keep the table so the measured one cannot reuse its heap.
    warm = Table(TableSpec("warm", 16, optimizer=ADAGRAD))
    warm.lookup(np.arange(200_000))
    batch = min(n, 1_000_000)
    base = np.arange(batch, dtype=np.int64)  # keys of batch k: (base + k * batch) * an odd constant, all distinct
    keys, out = np.empty_like(base), np.zeros((batch, 16), np.float32)
    gc.collect()
    before = rss_bytes()
    table = Table(TableSpec("mem", 16, optimizer=ADAGRAD))
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        np.multiply(base + start, 0x9E3779B97F4A7C15 - (1 << 64), out=keys)  # wraps: a bijection of int64
        table.lookup(keys, out=out)
    insert_s = time.perf_counter() - t0
    gc.collect()
    after = rss_bytes()
    assert len(table) == n and len(warm) == 200_000
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what remains is live data, not free heap glibc kept
    return {
        "rows": n,
        "rss_before": before,
        "rss_after": after,
        "peak_rss": rss_bytes("VmHWM"),
        "raw_row_bytes": 128,
        "bytes_per_row": (after - before) / n,
        "bytes_per_row_after_malloc_trim": (rss_bytes() - before) / n,
        "accounted_bytes_per_row": table.memory_bytes() / n,
        "insert_rows_per_s": n / insert_s,
    }


def client_run(echo: str, ps_addr: str, tuned: bool, calls: int, warmup: int) -> dict[str, Any]:
    """Ceiling vs ours from one client process; with ``tuned``, also the breakdown."""
    if tuned:
        tune_malloc()
    _, sets = workload()
    grads = (np.random.default_rng(SEED + 2).standard_normal((ROWS, DIM)) * 1e-3).astype(np.float32)
    lookup_req, push_req = lookup_request(sets[0]), push_request(sets[0], grads, "0" * 32, 1)
    channel = grpc.insecure_channel(echo, options=OPTIONS)
    raw_lookup, raw_push = (channel.unary_unary(f"/{ECHO_SERVICE}/{m}", None, None) for m in ("Lookup", "Push"))
    client = PSClient([ps_addr], ClientConfig(tune_malloc=tuned)).start()
    client.create_table(TABLE, DIM, optimizer="adagrad")  # idempotent: same spec
    out, it = np.empty((ROWS, DIM), np.float32), iter(range(1 << 30))
    ops: dict[str, Callable[[], object]] = {
        "ceiling_lookup": lambda: raw_lookup(lookup_req, timeout=60),
        "ours_lookup": lambda: client.lookup(TABLE, sets[next(it) % KEY_SETS], out=out),
        "ceiling_push": lambda: raw_push(push_req, timeout=60),
        "ours_push": lambda: client.push(TABLE, sets[next(it) % KEY_SETS], grads),
    }
    if tuned:  # the ceiling through ``future().result()``, the path GrpcTransport takes
        ops["ceiling_future_lookup"] = lambda: raw_lookup.future(lookup_req, timeout=60).result()
        # Two calls in flight at once (HTTP/2 streams), as a trainer with prefetch issues them.
        pool, outs = futures.ThreadPoolExecutor(2), [np.empty((ROWS, DIM), np.float32) for _ in range(2)]

        def both(*calls: Callable[[], object]) -> None:
            for f in [pool.submit(c) for c in calls]:
                f.result()

        ops["ceiling_lookup2"] = lambda: both(*[lambda: raw_lookup(lookup_req, timeout=60)] * 2)
        ops["ours_lookup2"] = lambda: both(
            *[lambda o=o: client.lookup(TABLE, sets[next(it) % KEY_SETS], out=o) for o in outs]
        )
        ops["ceiling_push2"] = lambda: both(*[lambda: raw_push(push_req, timeout=60)] * 2)
        ops["ours_push2"] = lambda: both(*[lambda: client.push(TABLE, sets[next(it) % KEY_SETS], grads)] * 2)
    result: dict[str, Any] = {
        "samples_s": run_rounds(ops, calls, warmup),
        "lookup_bytes": LOOKUP_BYTES,
        "push_bytes": len(push_req),
    }
    if tuned:
        result["breakdown_s"] = breakdown(ps_addr, sets, grads, calls, warmup)
    client.close()
    channel.close()
    return result


def breakdown(ps_addr: str, sets: list[Keys], grads: npt.NDArray[np.float32], calls: int, warmup: int) -> Samples:
    """The steps of ``PSClient.lookup`` / ``push`` timed one by one, then the server's handlers in-process."""
    transport = GrpcTransport([ps_addr], MAX_MSG)
    transport.start()
    out = np.empty((ROWS, DIM), np.float32)
    s: Samples = {k: [] for k in ("plan", "encode", "rpc_wait", "decode_scatter", "push_encode", "push_rpc_wait")}
    for i in range(warmup + calls):
        keys, ts = sets[i % KEY_SETS], [time.perf_counter()]
        plan = plan_table(TABLE, keys, DIM, 1)  # as PSClient.lookup_many does it, step by step
        _, parts = pack([plan], 1, lambda p: p.dim * 4 + 8, MAX_MSG)[0][0]
        ts.append(time.perf_counter())
        req = lookup_request(parts[0].keys)  # one shard, one table: one part
        ts.append(time.perf_counter())
        reply = transport.call(0, "Lookup", req, 60.0).result()
        ts.append(time.perf_counter())
        for part, res in zip(parts, wire.decode_lookup_response(reply)):
            rows = wire.decode_rows(res.rows, len(part), DIM, res.dtype, "rows")
            scatter_rows(out, rows, part.positions, np.arange(len(part), dtype=np.int64))
        ts.append(time.perf_counter())
        preq = push_request(plan_table(TABLE, keys, DIM, 1).unique, grads, "b" * 32, i + 1)
        ts.append(time.perf_counter())
        transport.call(0, "Push", preq, 60.0).result()
        ts.append(time.perf_counter())
        for k, a, z in zip(s, ts, ts[1:]):
            s[k] += [z - a] if i >= warmup else []
    transport.close()
    shard = Shard(0, 1)
    shard.create_table(TableSpec(TABLE, DIM, optimizer=ADAGRAD))
    resident, _ = workload()
    for start in range(0, RESIDENT, ROWS):
        shard.table(TABLE).lookup(resident[start : start + ROWS])
    servicer, ctx = Servicer(shard, MAX_MSG), cast(grpc.ServicerContext, None)  # ctx is only used on errors
    reqs = [lookup_request(k) for k in sets]
    pushes = [push_request(k, grads, "c" * 32, 0) for k in sets]  # seq 0: never deduplicated
    it = iter(range(1 << 30))
    handlers: dict[str, Callable[[], object]] = {
        "server_lookup": lambda: servicer.Lookup(reqs[next(it) % KEY_SETS], ctx),
        "server_push": lambda: servicer.Push(pushes[next(it) % KEY_SETS], ctx),
    }
    return {**s, **run_rounds(handlers, calls, warmup)}


def start(cmd: list[str], port_file: Path, procs: list[subprocess.Popen[bytes]], **env: str) -> tuple[str, float]:
    """Start ``cmd --port-file=port_file`` and wait for the file; returns (address, seconds from Popen to ready)."""
    port_file.unlink(missing_ok=True)
    log, cmd = port_file.with_suffix(".log"), [*cmd, f"--port-file={port_file}"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PS_")}, **env}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    with log.open("ab") as out:
        t0 = time.perf_counter()
        procs.append(proc := subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env))
    while not port_file.exists():
        if proc.poll() is not None or time.perf_counter() - t0 > 120:
            raise RuntimeError(f"{cmd} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.002)
    return f"127.0.0.1:{port_file.read_text().strip()}", time.perf_counter() - t0


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()  # SIGTERM; a no-op if it already exited
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()  # it ignored SIGTERM
            proc.wait()
    procs.clear()


def child(*args: str) -> dict[str, Any]:
    """Run this script with ``args`` in a fresh process; its last stdout line is the JSON result."""
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"child {args} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return cast(dict[str, Any], json.loads(done.stdout.strip().splitlines()[-1]))


def measure_ready(tmp: Path, warm_starts: int) -> dict[str, Any]:
    plan_table("x", np.arange(4), 4, 1)  # load this process's own client kernels first
    ready, first_call, procs = [], [], cast(list[subprocess.Popen[bytes]], [])
    for i in range(warm_starts + 1):
        cold = {"NUMBA_CACHE_DIR": str(tmp / "numba-cold")} if i == 0 else {}
        addr, t = start(PS_CMD, tmp / "ready.port", procs, **cold)
        t0 = time.perf_counter()
        with PSClient([addr]) as c:
            c.create_table("t", 16, optimizer="adagrad")
            c.lookup("t", np.arange(1024))
            c.push("t", np.arange(1024), np.ones((1024, 16), np.float32))
        first_call.append(time.perf_counter() - t0)
        ready.append(t)
        stop(procs)
    return {
        "cold_s": ready[0],
        "warm_s": ready[1:],
        "warm_median_s": statistics.median(ready[1:]),
        "first_call_cold_s": first_call[0],
        "first_call_warm_median_s": statistics.median(first_call[1:]),
    }


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, xs in run["samples_s"].items():
        per_call = run["lookup_bytes" if "lookup" in name else "push_bytes"]
        nbytes, p50 = per_call * (2 if name.endswith("2") else 1), statistics.median(xs)
        out[name] = {
            "p50_ms": 1e3 * p50,
            "p90_ms": 1e3 * float(np.percentile(xs, 90)),
            "gb_per_s": nbytes / p50 / 1e9,
            "m_rows_per_s": ROWS / p50 / 1e6,
        }
    for op in ("lookup", "push", "lookup2", "push2"):
        if f"ours_{op}" in out:
            out[f"{op}_ratio"] = out[f"ours_{op}"]["gb_per_s"] / out[f"ceiling_{op}"]["gb_per_s"]
    return out


def report(res: dict[str, Any]) -> str:
    rows = [("metric", "ours", "ceiling", "ratio", "goal", "pass")]
    speed = lambda d: f"{d['gb_per_s']:.2f} GB/s {d['p50_ms']:.1f} ms"  # noqa: E731
    for mode in ("default", "tuned"):
        s = res["summary"][mode]
        for op, goal in GOALS.items():
            r = s[f"{op}_ratio"]
            rows.append(
                (
                    f"{op.capitalize()} 64Ki x 64, client malloc {mode}",
                    speed(s[f"ours_{op}"]),
                    speed(s[f"ceiling_{op}"]),
                    f"{r:.2f}x",
                    f">= {goal}x",
                    str(r >= goal),
                )
            )
    s = res["summary"]["tuned"]
    for op, goal in GOALS.items():
        r2 = s[f"{op}2_ratio"]
        rows.append(
            (
                f"{op.capitalize()} 64Ki x 64, 2 calls in flight",
                speed(s[f"ours_{op}2"]),
                speed(s[f"ceiling_{op}2"]),
                f"{r2:.2f}x",
                f">= {goal}x",
                str(r2 >= goal),
            )
        )
    m, r = res["memory"], res["ready"]
    over = m["bytes_per_row"] - m["raw_row_bytes"]
    rows += [
        (
            f"Memory per row, dim 16 Adagrad, {m['rows']:,} rows",
            f"{m['bytes_per_row']:.1f} B",
            f"{m['raw_row_bytes']} B raw",
            f"+{over:.1f} B",
            f"<= +{OVER_BYTES} B",
            str(over <= OVER_BYTES),
        ),
        (
            "Ready time, warm numba cache (median of 5)",
            f"{r['warm_median_s']:.2f} s",
            "-",
            "-",
            f"<= {READY_S:g} s",
            str(r["warm_median_s"] <= READY_S),
        ),
        (
            "Ready time, cold numba cache (1st start)",
            f"{r['cold_s']:.2f} s",
            "-",
            "-",
            f"<= {READY_S:g} s",
            str(r["cold_s"] <= READY_S),
        ),
        (
            "First lookup+push after ready, cold / warm",
            f"{r['first_call_cold_s']:.2f} / {r['first_call_warm_median_s']:.2f} s",
            "-",
            "-",
            "-",
            "-",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    b, t = res["breakdown_ms"], res["summary"]["tuned"]
    total, push_total = (
        b["plan"] + b["encode"] + b["rpc_wait"] + b["decode_scatter"],
        b["push_encode"] + b["push_rpc_wait"],
    )
    lines += [
        "",
        f"Breakdown, client tuned, median ms (PSClient.lookup p50 {t['ours_lookup']['p50_ms']:.2f}, "
        f"PSClient.push p50 {t['ours_push']['p50_ms']:.2f}); % of the sum of the op's client steps:",
    ]
    for label, v, of in [
        ("Lookup: plan (dedup + group + pack)", b["plan"], total),
        ("Lookup: encode LookupRequest", b["encode"], total),
        ("Lookup: RPC wait (GrpcTransport future)", b["rpc_wait"], total),
        ("    of which server Lookup handler (in-process)", b["server_lookup"], total),
        ("    of which transport + gRPC (the rest)", b["rpc_wait"] - b["server_lookup"], total),
        ("Lookup: decode + scatter", b["decode_scatter"], total),
        ("Lookup ceiling, blocking call", t["ceiling_lookup"]["p50_ms"], total),
        ("Lookup ceiling, future().result()", t["ceiling_future_lookup"]["p50_ms"], total),
        ("Push: plan + encode PushRequest", b["push_encode"], push_total),
        ("Push: RPC wait (GrpcTransport future)", b["push_rpc_wait"], push_total),
        ("    of which server Push handler (in-process)", b["server_push"], push_total),
        ("    of which transport + gRPC (the rest)", b["push_rpc_wait"] - b["server_push"], push_total),
    ]:
        lines.append(f"  {label:<50}{v:7.2f}  {100 * v / of:5.1f}%")
    f = res["floors"]
    lines += ["", "Serial floor: the ceiling's call plus the work the op cannot skip, from the breakdown above:"]
    for op in ("lookup", "push"):
        lines.append(
            f"  {op.capitalize()}: {f[op]['ms']:.2f} ms -> {f[op]['ratio']:.2f}x the ceiling with none of it "
            f"overlapped; measured {t[f'{op}_ratio']:.2f}x ({t[f'{op}_ratio'] / f[op]['ratio']:.0%} of that)"
        )
    return "\n".join(lines)


def floors(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """What one call at a time can reach if nothing overlaps: the ceiling's RPC plus the work no
    lookup (dedup, probe and gather, copy into the caller's rows) or push (dedup, encode, the
    optimizer on the shard) can skip, each as measured in this run's breakdown."""
    b, t = res["breakdown_ms"], res["summary"]["tuned"]
    ceiling = {op: t[f"ceiling_{op}"]["p50_ms"] for op in ("lookup", "push")}
    work = {
        "lookup": b["plan"] + b["encode"] + b["server_lookup"] + b["decode_scatter"],
        "push": b["push_encode"] + b["server_push"],
    }
    return {op: {"ms": ceiling[op] + work[op], "ratio": ceiling[op] / (ceiling[op] + work[op])} for op in ceiling}


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # here only: measuring does not need it

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    groups = [(op, mode) for op in ("lookup", "push") for mode in ("default", "tuned")]
    for i, who in enumerate(("ceiling", "ours")):
        vals = [res["summary"][mode][f"{who}_{op}"]["gb_per_s"] for op, mode in groups]
        ax1.bar(np.arange(4) + (i - 0.5) * 0.38, vals, 0.38, label=who)
    ax1.set_xticks(np.arange(4), [f"{op}\nmalloc {mode}" for op, mode in groups])
    ax1.set(ylabel="GB/s (message bytes / median latency)", title=f"{ROWS:,} keys x dim {DIM}, loopback gRPC")
    b, t, left = res["breakdown_ms"], res["summary"]["tuned"], 0.0
    for name, v in [
        ("plan", b["plan"]),
        ("encode", b["encode"]),
        ("server handler", b["server_lookup"]),
        ("transport+gRPC", b["rpc_wait"] - b["server_lookup"]),
        ("decode+scatter", b["decode_scatter"]),
    ]:
        ax2.barh(1, v, left=left, label=name)
        left += v
    ax2.barh(0, t["ceiling_lookup"]["p50_ms"], color="grey", label="ceiling RPC")
    ax2.axvline(t["ours_lookup"]["p50_ms"], color="black", ls="--", label="PSClient.lookup p50")
    ax2.set(yticks=[0, 1], yticklabels=["ceiling", "ours"], xlabel="ms per lookup (median, client tuned)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(quick: bool) -> None:
    calls, warmup = (9, 3) if quick else (60, 5)
    machine = {
        "nproc": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "numpy": np.__version__,
        "numba": numba.__version__,
        "platform": platform.platform(),
    }
    res: dict[str, Any] = {
        "quick": quick,
        "calls": calls,
        "warmup": warmup,
        "machine": machine,
        "loadavg_start": os.getloadavg(),
    }
    t_start, procs = time.perf_counter(), cast(list[subprocess.Popen[bytes]], [])
    with tempfile.TemporaryDirectory(prefix="bench-foundation-") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            print("measuring ready time, memory per row, then throughput ...", file=sys.stderr)
            res["ready"] = measure_ready(tmp, 5)
            res["memory"] = child("--memory-child", str(1_000_000 if quick else 10_000_000))
            echo, _ = start([sys.executable, __file__, "--echo-server"], tmp / "echo.port", procs)
            ps_addr, _ = start(PS_CMD, tmp / "ps.port", procs)
            with PSClient([ps_addr]) as c:
                c.create_table(TABLE, DIM, optimizer="adagrad")
                resident, _ = workload()
                for i in range(0, RESIDENT, ROWS):
                    c.lookup(TABLE, resident[i : i + ROWS])
                res["ps_stats_after_populate"] = c.admin.stats()
            common = ["--echo", echo, "--ps", ps_addr, "--calls", str(calls), "--warmup", str(warmup)]
            runs = {"default": child("--client-run", *common), "tuned": child("--client-run", "--tuned", *common)}
        finally:
            stop(procs)
    res["breakdown_s"] = runs["tuned"].pop("breakdown_s")
    res["breakdown_ms"] = {k: 1e3 * statistics.median(v) for k, v in res["breakdown_s"].items()}
    res["runs"], res["summary"] = runs, {mode: summarize(run) for mode, run in runs.items()}
    res["floors"] = floors(res)
    res["loadavg_end"], res["wall_s"] = os.getloadavg(), time.perf_counter() - t_start
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "foundation.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        chart(res, RESULTS / "foundation.png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG chart written")
    print(report(res))
    print(
        f"\n{res['machine']}\nloadavg {res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}; "
        f"wall {res['wall_s']:.0f} s; wrote {RESULTS}/foundation.{{json,png}}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer calls, 1M rows for the memory test (~15 s)")
    for flag in ("--echo-server", "--client-run", "--tuned"):  # internal: how this script runs its children
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    internal = {"--port-file": Path, "--memory-child": int, "--echo": str, "--ps": str, "--calls": int, "--warmup": int}
    for flag, kind in internal.items():
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.echo_server:
        echo_server(a.port_file)
    elif a.memory_child:
        print(json.dumps(memory_child(a.memory_child)))
    elif a.client_run:
        print(json.dumps(client_run(a.echo, a.ps, a.tuned, a.calls, a.warmup)))
    else:
        main(a.quick)
