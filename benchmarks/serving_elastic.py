"""The serving benchmark's ``elastic`` and ``startup`` parts: serving replicas that join and
leave under load, and how long a new replica takes to be ready. ``bench_serving.py`` runs
them; see its docstring.

``elastic``: 2 training shards hold ``rows`` rows (dim 64); serving replicas follow them
(``deploy.replicas.ServingReplicas``) and a ``PSClient(addresses_file=...)`` follows their
addresses file. ``CONCURRENCY_ELASTIC`` threads look up requests of 2,600 keys in a loop
(every answer checked against the training rows, so a replica that served anything else
counts as a failure) through two timelines of equal length:

* fixed: 2 replicas per shard throughout;
* elastic: 1 per shard; at 1/6 of the run a second joins each shard, at 2/6 a third; at 3/6
  one of each shard is removed (SIGTERM: it drains, then exits); at 4/6 one of shard 1 is
  ``kill -9``ed; then 2 of shard 0 and 1 of shard 1 serve to the end.

Requests/s and p99 per second go to the chart; the goal compares the p99 of the calls that
started within ``EVENT_WINDOW_S`` after each event with the fixed run's p99, and counts
failures (goal: <= 1.5x, 0 failed). Then requests/s at a saturating concurrency with 1
and with 2 replicas per shard (the ratio is bounded by the cores: 2 here), and, with
hedging at ``HEDGE_MS``, p99 while one replica of shard 0 is stopped (SIGSTOP) against
the hedge delay plus a healthy call's p99.

``startup``: a new replica's start (process spawned) to ready (health SERVING: it has its
training shard's snapshot) at 1M and 10M rows of dim 16 on 2 training shards (100K and
1M with ``--quick``); the snapshot's rows per second beside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: client/, deploy/
sys.path.insert(1, str(Path(__file__).resolve().parent))  # serving_parts, beside this file

from serving_parts import DIM, KEYS, SHARDS, Setup, run_threads, summarize  # noqa: E402

from client import ClientConfig, PSClient  # noqa: E402
from deploy.local import LocalCluster, spawn_shard  # noqa: E402
from deploy.replicas import ServingReplicas  # noqa: E402

TABLE = "elastic"
CONCURRENCY_ELASTIC, CONCURRENCY_SATURATE = 4, 8
EVENT_WINDOW_S = 2.0  # calls that start this long after an event count as "during" it
HEDGE_MS = 20.0
ELASTIC_GOAL = 1.5  # p99 during events <= this x the fixed run's p99
Keys = npt.NDArray[np.int64]
Rows = npt.NDArray[np.float32]


def health_status(address: str) -> str:
    """The server's overall gRPC health status name, or the status code's when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _fill(addresses: list[str], rows: int, dim: int, batch: int = 65_536) -> Keys:
    """A table of ``rows`` rows (random keys) on the training shards; returns the keys."""
    keys = np.unique(np.random.default_rng(11).integers(0, 1 << 62, size=rows, dtype=np.int64))
    with PSClient(addresses) as client:
        client.create_table(TABLE, dim, initializer="normal", seed=1)
        for i in range(0, len(keys), batch):
            client.lookup(TABLE, keys[i : i + batch])  # a training shard makes the rows it is asked for
    return keys


def _wait_ready(replicas: ServingReplicas, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(health_status(a) == "SERVING" for shard in replicas.addresses for a in shard):
        if time.monotonic() > deadline:
            raise RuntimeError(f"serving replicas {replicas.addresses} not ready after {timeout_s:.0f} s")
        time.sleep(0.05)


class Timeline:
    """Lookups on ``CONCURRENCY_ELASTIC`` threads, each call's start, latency and outcome."""

    def __init__(self, client: PSClient, requests: list[Keys], expected: list[Rows]) -> None:
        self.client, self.requests, self.expected = client, requests, expected
        self.calls: list[tuple[float, float, bool]] = []  # (start, seconds, ok)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(CONCURRENCY_ELASTIC)]
        self.t0 = time.monotonic()

    def _run(self, t: int) -> None:
        i = t * 7919
        while not self._stop.is_set():
            n = i % len(self.requests)
            start = time.monotonic()
            try:
                got = self.client.lookup(TABLE, self.requests[n])
                ok = bool(np.array_equal(got, self.expected[n]))
                if not ok:
                    self.errors.append(f"request {n}: rows differ from the training shards'")
            except Exception as exc:  # counted: the goal is none
                ok = False
                self.errors.append(repr(exc))
            self.calls.append((start - self.t0, time.monotonic() - start, ok))
            i += 1

    def start(self) -> Timeline:
        self.t0 = time.monotonic()
        for th in self._threads:
            th.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(60)

    def per_second(self, seconds: float) -> dict[str, list[float]]:
        starts = np.array([c[0] for c in self.calls])
        took = np.array([c[1] for c in self.calls]) * 1e3
        rps, p99 = [], []
        for s in range(int(seconds)):
            mask = (starts >= s) & (starts < s + 1)
            rps.append(float(mask.sum()))
            p99.append(float(np.percentile(took[mask], 99)) if mask.any() else 0.0)
        return {"requests_per_s": rps, "p99_ms": p99}

    def window(self, begin: float, end: float) -> dict[str, float]:
        took = [c[1] for c in self.calls if begin <= c[0] < end]
        return {
            **summarize(took, max(1e-9, end - begin)),
            "failed": sum(not c[2] for c in self.calls if begin <= c[0] < end),
        }


def _timeline(
    replicas: ServingReplicas, requests: list[Keys], expected: list[Rows], seconds: float, elastic: bool
) -> dict[str, Any]:
    config = ClientConfig(deadline_s=30, membership_refresh_s=0.5)
    events: list[tuple[float, str]] = []
    with PSClient(addresses_file=replicas.addresses_file, config=config) as client:
        client.lookup(TABLE, requests[0])  # channels open
        line = Timeline(client, requests, expected).start()
        actions: list[threading.Thread] = []
        try:
            step = seconds / 6
            remove = replicas.remove
            for k, (what, acts) in enumerate(
                [
                    ("+1 replica per shard", [lambda s=s: replicas.add(s) for s in range(SHARDS)]),
                    ("+1 replica per shard", [lambda s=s: replicas.add(s) for s in range(SHARDS)]),
                    ("SIGTERM 1 per shard", [lambda s=s: remove(replicas.addresses[s][0]) for s in range(SHARDS)]),
                    ("kill -9 1 of shard 1", [lambda: remove(replicas.addresses[1][0], kill=True)]),
                ],
                start=1,
            ):
                time.sleep(max(0.0, line.t0 + k * step - time.monotonic()))
                if elastic:  # each on a thread of its own: a draining replica takes seconds to exit
                    events.append((time.monotonic() - line.t0, what))
                    for act in acts:
                        actions.append(threading.Thread(target=act))
                        actions[-1].start()
            time.sleep(max(0.0, line.t0 + seconds - time.monotonic()))
        finally:
            for action in actions:
                action.join(120)
            line.stop()
    out: dict[str, Any] = {
        "events": [{"at_s": at, "what": what} for at, what in events],
        "overall": line.window(0.0, seconds),
        "timeline": line.per_second(seconds),
        "errors": line.errors[:5],
    }
    if events:
        during = [c[1] for c in line.calls if any(at <= c[0] < at + EVENT_WINDOW_S for at, _ in events)]
        out["during_events"] = summarize(during, len(events) * EVENT_WINDOW_S)
        for e in out["events"]:
            e["p99_ms"] = line.window(e["at_s"], e["at_s"] + EVENT_WINDOW_S)["p99_ms"]
    return out


def _starts_only(
    replicas: ServingReplicas, requests: list[Keys], expected: list[Rows], seconds: float
) -> dict[str, Any]:
    """The floor of a joining replica's cost: the fixed replica set under the same load, and
    at the times replicas join in the elastic run, as many processes that start as a replica
    does (the interpreter and the shard's modules) and exit, joining nothing."""
    config = ClientConfig(deadline_s=30, membership_refresh_s=0.5)
    starts: list[float] = []
    command = [sys.executable, "-c", "import ps.service.server, ps.replication.follow, client"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with PSClient(addresses_file=replicas.addresses_file, config=config) as client:
        client.lookup(TABLE, requests[0])
        line = Timeline(client, requests, expected).start()
        try:
            for k in (1, 2):
                time.sleep(max(0.0, line.t0 + k * seconds / 6 - time.monotonic()))
                starts.append(time.monotonic() - line.t0)
                procs = [subprocess.Popen(command, env=env) for _ in range(SHARDS)]
                for proc in procs:
                    proc.wait()
            time.sleep(max(0.0, line.t0 + seconds / 2 - time.monotonic()))
        finally:
            line.stop()
    during = [c[1] for c in line.calls if any(at <= c[0] < at + EVENT_WINDOW_S for at in starts)]
    return {"during_starts": summarize(during, len(starts) * EVENT_WINDOW_S), "overall": line.window(0.0, seconds / 2)}


def elastic_part(setup: Setup) -> dict[str, Any]:
    root = setup.tmp / "elastic"
    rows = min(setup.rows, 200_000)
    seconds = 12.0 if setup.quick else 36.0
    with LocalCluster(SHARDS, root=root / "training") as training:
        keys = _fill(training.addresses, rows, DIM)
        rng = np.random.default_rng(5)
        requests = [keys[rng.choice(len(keys), KEYS, replace=False)] for _ in range(64)]
        with PSClient(training.addresses) as client:
            expected = [client.lookup(TABLE, r) for r in requests]
        result: dict[str, Any] = {"rows": rows, "seconds": seconds, "concurrency": CONCURRENCY_ELASTIC}
        print(f"elastic: {rows:,} rows; a fixed run and an elastic run of {seconds:.0f} s each ...", file=sys.stderr)
        with ServingReplicas(training.addresses, root / "fixed", per_shard=2) as replicas:
            _wait_ready(replicas)
            result["fixed"] = _timeline(replicas, requests, expected, seconds, elastic=False)
            result["starts_only"] = _starts_only(replicas, requests, expected, seconds)
            result["saturate"] = _saturate(replicas, requests, setup)
            result["hedge"] = _hedged(replicas, requests, setup)
        with ServingReplicas(training.addresses, root / "elastic", per_shard=1) as replicas:
            _wait_ready(replicas)
            result["elastic"] = _timeline(replicas, requests, expected, seconds, elastic=True)
    fixed_p99, during = result["fixed"]["overall"]["p99_ms"], result["elastic"]["during_events"]["p99_ms"]
    failed = result["elastic"]["overall"]["failed"] + result["fixed"]["overall"]["failed"]
    result["goal"] = {
        "goal": "p99 during replica events vs the fixed run's p99, and failed requests",
        "ratio": during / fixed_p99,
        "failed": failed,
        "target": f"<= {ELASTIC_GOAL:g}x, 0 failed",
        "pass": during / fixed_p99 <= ELASTIC_GOAL and failed == 0,
    }
    result["report"] = _report(result)
    return result


def _saturate(replicas: ServingReplicas, requests: list[Keys], setup: Setup) -> dict[str, Any]:
    """Requests/s at ``CONCURRENCY_SATURATE`` through 1 replica per shard, then 2."""
    out: dict[str, Any] = {}
    seconds = max(1.0, setup.seconds)
    for n in (1, 2):
        addresses = [shard[:n] for shard in replicas.addresses]
        with PSClient(addresses, ClientConfig(deadline_s=30)) as client:
            for _ in range(3):
                client.lookup(TABLE, requests[0])
            latencies, wall = run_threads(
                lambda i: client.lookup(TABLE, requests[i % len(requests)]), CONCURRENCY_SATURATE, seconds
            )
        out[f"{n}_per_shard"] = summarize(latencies, wall)
    out["ratio"] = out["2_per_shard"]["requests_per_s"] / out["1_per_shard"]["requests_per_s"]
    out["cores"] = os.cpu_count()
    return out


def _hedged(replicas: ServingReplicas, requests: list[Keys], setup: Setup) -> dict[str, Any]:
    """p99 with hedging on, healthy and with one replica of shard 0 stopped (SIGSTOP)."""
    seconds = max(1.0, setup.seconds)
    config = ClientConfig(deadline_s=30, hedge_after_s=HEDGE_MS / 1e3)
    out: dict[str, Any] = {"hedge_after_ms": HEDGE_MS}
    with PSClient(replicas.addresses, config) as client:
        for _ in range(3):
            client.lookup(TABLE, requests[0])
        call = lambda i: client.lookup(TABLE, requests[i % len(requests)])  # noqa: E731
        out["healthy"] = summarize(*run_threads(call, 1, seconds))
        pid = replicas.replicas[0][0].proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            out["one_stopped"] = summarize(*run_threads(call, 1, seconds))
        finally:
            os.kill(pid, signal.SIGCONT)
    out["bound_ms"] = HEDGE_MS + out["healthy"]["p99_ms"]
    out["pass"] = out["one_stopped"]["p99_ms"] <= out["bound_ms"]
    return out


def startup_part(setup: Setup) -> dict[str, Any]:
    """Spawn to ready (health SERVING) of a new replica, at each size."""
    sizes = (100_000, 1_000_000) if setup.quick else (1_000_000, 10_000_000)
    out: dict[str, Any] = {"dim": 16, "sizes": {}}
    for rows in sizes:
        root = setup.tmp / f"startup-{rows}"
        print(f"startup: {rows:,} rows ...", file=sys.stderr)
        with LocalCluster(SHARDS, root=root / "training") as training:
            _fill(training.addresses, rows, 16)
            began = time.monotonic()
            replica = spawn_shard(0, SHARDS, root / "serve", "--mode=serve", f"--follow={training.addresses[0]}")
            try:
                port_file = root / "serve" / "port.0"
                while not port_file.exists():
                    if replica.proc.poll() is not None:
                        raise RuntimeError(f"replica did not start:\n{replica.log_tail()}")
                    time.sleep(0.01)
                listening = time.monotonic() - began
                address = f"127.0.0.1:{port_file.read_text().strip()}"
                while health_status(address) != "SERVING":
                    if replica.proc.poll() is not None or time.monotonic() - began > 1800:
                        raise RuntimeError(f"replica not ready:\n{replica.log_tail()}")
                    time.sleep(0.02)
                ready = time.monotonic() - began
            finally:
                replica.proc.kill()
                replica.proc.wait()
        shard_rows = rows / SHARDS
        out["sizes"][str(rows)] = {
            "listening_s": listening,
            "ready_s": ready,
            "shard_rows": shard_rows,
            "rows_per_s": shard_rows / max(1e-9, ready - listening),
        }
    out["report"] = [
        "a new serving replica, spawned to ready (health SERVING, its shard's snapshot applied), 2 training shards, "
        "dim 16:"
    ] + [
        f"  {int(r):>10,} rows: listening after {x['listening_s']:.2f} s, ready after {x['ready_s']:.2f} s "
        f"({x['shard_rows']:,.0f} rows of its shard, {x['rows_per_s'] / 1e6:.2f}M rows/s)"
        for r, x in out["sizes"].items()
    ]
    return out


def _report(r: dict[str, Any]) -> list[str]:
    f, e = r["fixed"]["overall"], r["elastic"]["overall"]
    d = r["elastic"]["during_events"]
    s, h, g = r["saturate"], r["hedge"], r["goal"]
    lines = [
        f"lookups of {KEYS:,} keys x dim {DIM} at concurrency {r['concurrency']} through an addresses file, "
        f"{r['rows']:,} rows, {r['seconds']:.0f} s per run",
        f"  fixed, 2 replicas per shard: p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, "
        f"{f['requests_per_s']:.0f} requests/s, {f['failed']} failed",
        f"  elastic (1 -> 2 -> 3 -> 2 per shard, then kill -9 one): p50 {e['p50_ms']:.1f} ms, p99 {e['p99_ms']:.1f} ms, "
        f"{e['requests_per_s']:.0f} requests/s, {e['failed']} failed",
        f"  during events ({EVENT_WINDOW_S:g} s after each): p99 {d['p99_ms']:.1f} ms ({d['requests']} calls)",
    ]
    lines += [
        f"    at {ev['at_s']:5.1f} s: {ev['what']:<22} p99 {ev['p99_ms']:.1f} ms" for ev in r["elastic"]["events"]
    ]
    so = r["starts_only"]
    lines.append(
        f"  floor: the fixed set while {SHARDS} bare processes start as replicas would (imports only), at the "
        f"join times: p99 {so['during_starts']['p99_ms']:.1f} ms "
        f"({so['during_starts']['p99_ms'] / f['p99_ms']:.2f}x the fixed run's)"
    )
    lines += [
        f"  goal: {g['goal']}: {g['ratio']:.2f}x, {g['failed']} failed (target {g['target']}): {g['pass']}",
        f"  saturating (concurrency {CONCURRENCY_SATURATE}): {s['1_per_shard']['requests_per_s']:.0f} requests/s with "
        f"1 replica per shard, {s['2_per_shard']['requests_per_s']:.0f} with 2 ({s['ratio']:.2f}x; "
        f"{s['cores']} cores shared by client and replicas)",
        f"  hedged at {h['hedge_after_ms']:g} ms, concurrency 1: p99 healthy {h['healthy']['p99_ms']:.1f} ms, "
        f"one replica of shard 0 stopped {h['one_stopped']['p99_ms']:.1f} ms (bound: hedge + healthy p99 = "
        f"{h['bound_ms']:.1f} ms): {h['pass']}",
    ]
    if r["elastic"]["errors"] or r["fixed"]["errors"]:
        lines.append(f"  first errors: {r['elastic']['errors'] + r['fixed']['errors']}")
    return lines


def elastic_chart(r: dict[str, Any], path: Path) -> None:
    """Requests/s and p99 per second of the fixed and the elastic run, the events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # here only: measuring does not need it

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in ("fixed", "elastic"):
        line = r[name]["timeline"]
        x = np.arange(len(line["requests_per_s"])) + 0.5
        top.plot(x, line["requests_per_s"], label=name)
        bottom.plot(x, line["p99_ms"], label=name)
    for ax in (top, bottom):
        for ev in r["elastic"]["events"]:
            ax.axvline(ev["at_s"], color="grey", linestyle=":", linewidth=1)
    for ev in r["elastic"]["events"]:
        top.text(ev["at_s"], 0.02, " " + ev["what"], transform=top.get_xaxis_transform(), rotation=90, fontsize=7)
    top.set(ylabel="requests/s", title=f"lookups through an addresses file, concurrency {r['concurrency']}")
    bottom.set(ylabel="p99 ms (per second)", xlabel="seconds")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
