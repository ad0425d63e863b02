"""Resume benchmark: from a worker's death to its group's first step after the restart.

Goal: <= 10 s with 10M rows on the shards. The peer, measured in the same run: a cold start
of the same group (processes started to its first step), which a restart repeats almost
whole; resume / cold start says what the restart adds (noticing the death, stopping the
others, meeting again).

Set-up: 2 local shards (``LocalCluster``); ``--rows`` rows are created in the trainer's own
``embedding`` table first (lookups of random keys, 1M a call), so the shards hold them the
whole time. Then ``--workers`` trainer processes (``python -m worker.trainer``, synthetic data,
``--mode sync``, a checkpoint every ``--checkpoint-every`` steps) run under ``deploy.workers``,
elastic torchrun as ``ps-launch`` runs it. Each round waits for two checkpoints and then half the
time between them, notes the time, sends SIGKILL to one worker (the ranks in turn), and waits for the restarted group's first step:
the first push the shards report as a duplicate (a step trained again after its checkpoint:
the group that died cannot send one, as its steps were new). Phases from the processes'
start times and the trainer's log: death -> the new trainer process starts (torchrun notices,
stops the others, meets again, starts them), -> its ``resuming from`` line (imports, joining
the process group, reading the data and the checkpoint), -> first step (model, tables, the
first lookup and push). Sync mode makes that push the end of the step (pipelined sends it one
lookup later). ``--rounds`` kills; the medians are reported. The machine is shared: figures
drift run to run, compare the ratio.

Usage: ``python benchmarks/bench_resume.py [--quick] [--rows N] [--workers W] [--rounds R]``
-> ``benchmarks/results/resume.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from client import ClientConfig, PSClient  # noqa: E402
from deploy.local import LocalCluster, threads_beside_local_shards  # noqa: E402
from deploy.workers import RENDEZVOUS_FILE, Elastic, torchrun_command  # noqa: E402
from worker.config import TrainerConfig  # noqa: E402
from worker.loop import trainer_tables  # noqa: E402

GOAL_S = 10.0
RESULTS = REPO / "benchmarks" / "results"
BATCH = 512
CHUNK = 1 << 20  # keys per lookup while filling the table
_TS = re.compile(r"^ts=(\S+ \S+) .*resuming from")


def fill(client: PSClient, config: TrainerConfig, rows: int) -> float:
    """Create ``rows`` rows in the trainer's ``embedding`` table (as it will create it); returns seconds."""
    t0 = time.perf_counter()
    for t in trainer_tables(config):
        client.create_table(
            t.name,
            t.dim,
            optimizer=t.optimizer,
            initializer=t.initializer,
            seed=t.seed,
            serving_default=t.serving_default,
            **dict(t.params),
        )
    rng = np.random.default_rng(7)
    for lo in range(0, rows, CHUNK):
        keys = rng.integers(1 << 40, 1 << 62, size=min(CHUNK, rows - lo), dtype=np.int64)
        client.lookup_many({"embedding": keys})  # a training shard creates the row of a new key
    return time.perf_counter() - t0


class Counters:
    """The shards' push counters: keys pushed (applied) and pushes found applied before."""

    def __init__(self, client: PSClient) -> None:
        self.client = client

    def __call__(self) -> tuple[int, int]:
        stats = self.client.admin.stats()
        pushed = sum(int(t["pushes"]) for s in stats for t in s["tables"])
        return pushed, sum(int(s.get("duplicate_pushes", 0)) for s in stats)


def trainers(out: Path) -> dict[int, float]:
    """Running trainer processes (not their torchrun agents): pid -> start time (epoch seconds)."""
    needle = f"--output-dir={out}".encode()
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text().split(") ")[-1].split()
        except OSError:
            continue
        if needle in argv and b"worker.trainer" in argv and b"deploy.workers" not in argv and stat[0] not in "ZX":
            found[int(proc.name)] = boot + int(stat[19]) / ticks
    return found


def wait_for(what: str, ready: Any, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value:
            return value
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s; the workers' log:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)


def resumed_at(log: Path, after: float) -> float | None:
    """Time (epoch seconds) of the first ``resuming from`` line of the trainer logged after ``after``."""
    for line in log.read_text().splitlines():
        m = _TS.match(line)
        if m:
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at > after:
                return at
    return None


def run(rows: int, workers: int, rounds: int, every: int, samples: int, tmp: Path) -> dict[str, Any]:
    out, log_path, ckpt = tmp / "run", tmp / "workers.log", tmp / "checkpoints"
    config = TrainerConfig(batch_size=BATCH, train_samples=samples)
    res: dict[str, Any] = {"rows": rows, "workers": workers, "checkpoint_every": every, "rounds": []}
    with LocalCluster(2, tmp / "shards") as cluster:
        stats = PSClient(cluster.addresses, ClientConfig(deadline_s=60, tune_malloc=False))
        with stats:
            res["fill_s"] = fill(stats, config, rows)
            count = Counters(stats)
            command = [
                sys.executable,
                "-m",
                "worker.trainer",
                f"--train-samples={samples}",
                "--eval-samples=1024",
                f"--batch-size={BATCH}",
                "--epochs=1",
                "--mode=sync",
                f"--checkpoint-every={every}",
                f"--checkpoint-dir={ckpt}",
                "--progress=false",
                f"--output-dir={out}",
            ]
            env = os.environ | {
                "TRAINER_ADDRESSES": ",".join(cluster.addresses),
                "OMP_NUM_THREADS": str(threads_beside_local_shards(workers)),
            }
            elastic = Elastic("1:4", rounds + 1, "bench-resume")
            launch = torchrun_command(workers, command, elastic, host=tmp / RENDEZVOUS_FILE)
            before = count()
            started = time.time()
            with log_path.open("wb") as log:
                proc = subprocess.Popen(launch, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
                try:
                    wait_for("a first step", lambda: count()[0] > before[0], 600, proc, log_path)
                    res["cold_start_s"] = time.time() - started
                    for r in range(rounds):
                        res["rounds"].append(kill_once(r, workers, out, ckpt, count, proc, log_path))
                        print(
                            f"round {r + 1}: resumed in {res['rounds'][-1]['resume_s']:.2f} s "
                            f"(cold start {res['cold_start_s']:.2f} s)",
                            flush=True,
                        )
                finally:
                    if proc.poll() is None:
                        proc.terminate()  # torchrun stops its workers
                        proc.wait(60)
    return res


def kill_once(
    r: int,
    workers: int,
    out: Path,
    ckpt: Path,
    count: Counters,
    proc: subprocess.Popen[bytes],
    log: Path,
) -> dict[str, Any]:
    """Kill a worker half a checkpoint interval after a checkpoint; time the group's way back."""

    def newest() -> int:
        return max((int(p.name[11:20]) for p in ckpt.glob("checkpoint-*.pt")), default=-1)

    # Two checkpoints give the interval's length; the kill comes half of it after the second,
    # so the restarted group trains some steps again (their pushes are the duplicates awaited).
    floor = newest()
    wait_for("a checkpoint", lambda: newest() > floor, 600, proc, log)
    first, t1 = newest(), time.monotonic()
    wait_for("the next checkpoint", lambda: newest() > first, 600, proc, log)
    time.sleep((time.monotonic() - t1) / 2)
    old = trainers(out)
    ranks = sorted(old)
    victim = ranks[r % len(ranks)]
    dups = count()[1]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    wait_for("the first step after the restart", lambda: count()[1] > dups, 600, proc, log)
    back = time.time()
    new = {p: t for p, t in trainers(out).items() if p not in old}
    respawned = min(new.values(), default=float("nan"))
    resumed = resumed_at(log, killed) or float("nan")
    return {
        "victim_pid": victim,
        "workers": workers,
        "resume_s": back - killed,
        "phases_s": {
            "restart": respawned - killed,
            "start_to_resume": resumed - respawned,
            "resume_to_first_step": back - resumed,
        },
    }


def median_of(res: dict[str, Any], key: str) -> float:
    return statistics.median(r["phases_s"][key] if key in r["phases_s"] else r[key] for r in res["rounds"])


def report(res: dict[str, Any]) -> str:
    resume, cold = median_of(res, "resume_s"), res["cold_start_s"]
    lines = [
        f"Resume with {res['rows']:,} rows on 2 shards, {res['workers']} workers, a checkpoint every "
        f"{res['checkpoint_every']} steps ({len(res['rounds'])} kills; medians; {res['machine']})",
        "",
        f"{'':<44}{'seconds':>10}",
        f"{'death -> first step after the restart':<44}{resume:>10.2f}   goal <= {GOAL_S:.0f} s: "
        f"{'PASS' if res['pass'] else 'FAIL'}",
        f"{'  death -> new trainer process':<44}{median_of(res, 'restart'):>10.2f}",
        f"{'  process start -> resuming from checkpoint':<44}{median_of(res, 'start_to_resume'):>10.2f}",
        f"{'  resumed -> first step':<44}{median_of(res, 'resume_to_first_step'):>10.2f}",
        f"{'peer: cold start -> first step':<44}{cold:>10.2f}   resume / cold start {resume / cold:.2f}x",
        f"{'(filling the table, not timed above)':<44}{res['fill_s']:>10.2f}",
    ]
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    phases = [("restart", "torchrun restarts the group"), ("start_to_resume", "start -> checkpoint read")]
    phases.append(("resume_to_first_step", "-> first step"))
    left = 0.0
    for key, label in phases:
        width = median_of(res, key)
        ax.barh(1, width, left=left, label=label)
        left += width
    ax.barh(0, res["cold_start_s"], color="0.6", label="cold start (peer)")
    ax.axvline(GOAL_S, ls="--", color="k", lw=0.8, label=f"goal {GOAL_S:.0f} s")
    ax.set_yticks([0, 1], ["cold start", "resume"])
    ax.set_xlabel("seconds to the first step")
    ax.set_title(f"Worker death to first step, {res['rows'] / 1e6:g}M rows on the shards")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(quick: bool, rows: int | None, workers: int, rounds: int | None) -> None:
    rows = rows if rows is not None else (200_000 if quick else 10_000_000)
    rounds = rounds if rounds is not None else (1 if quick else 3)
    every = 16 if quick else 50
    # Enough steps that the last kill comes well before the end: rounds of 2 checkpoint intervals each.
    samples = BATCH * workers * every * (2 * rounds + 4) * 2
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as d:
        res = run(rows, workers, rounds, every, samples, Path(d))
    res |= {"machine": platform.platform(), "quick": quick, "goal_s": GOAL_S, "batch": BATCH}
    res["resume_s"] = median_of(res, "resume_s")
    res["resume_over_cold_start"] = res["resume_s"] / res["cold_start_s"]
    res["pass"] = res["resume_s"] <= GOAL_S
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "resume.json").write_text(json.dumps(res, indent=1))
    print(report(res))
    try:
        chart(res, RESULTS / "resume.png")
    except ImportError:
        print("(matplotlib not installed: no chart; pip install '.[bench]')")
    print(f"wrote {RESULTS}/resume.{{json,png}}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200K rows and one kill, for a smoke run")
    parser.add_argument("--rows", type=int, help="rows on the shards (default 10M; --quick 200K)")
    parser.add_argument("--workers", type=int, default=2, help="trainer processes (default 2)")
    parser.add_argument("--rounds", type=int, help="kills to time (default 3; --quick 1)")
    args = parser.parse_args()
    main(args.quick, args.rows, args.workers, args.rounds)
