"""The cluster changes under a training run and nothing is lost, applied twice or failed.

A pipelined DLRM run under ``ps-launch`` (every-push durability, one worker recording
every push: ``tests/faults/recording_worker.py``) while the cluster grows 2 -> 3 -> 4
shards and shrinks 4 -> 3 (``ps-launch --scale``); one shard is killed with SIGKILL
during the move to 4 shards, and the worker once, after a checkpoint (torchrun restarts
it, the trainer resumes and sends again the pushes of the steps after the checkpoint:
the shards must recognise them). Meanwhile ``ps-infer`` on the serving shards that
follow the training shards takes a steady Predict load, which must never fail.

The model ps-infer serves is that of a short run before, on the same data dirs (the
shards' rows keep their lineage), so it loads while the measured run trains.

The checks, after the run exits 0:

* every key pushed is stored on exactly one shard, the one ``shard_of(key, 3)`` names
  (read from the data dirs; the shard retired by the shrink holds no row);
* its row equals, bit for bit, an in-process twin cluster that applied every push the
  worker saw acknowledged once, in order. A push sent when the worker was killed, not
  acknowledged, and sent again (recomputed, so with other gradients) after the resume is
  the one case the worker cannot know: the first send may have reached a shard or not.
  For those few seqs the twin is built both ways, and each row must equal one of them;
* no Predict request failed, and there were some during every move; a ps-infer started
  after the moves, given the serving shards' first addresses, serves too.

The slowest step of training during each move is printed (with the moves' durations),
not asserted. A plain run is short; ``pytest -m slow`` runs longer and also trains the
same two runs on a cluster that stays at 2 shards, and compares the AUC (within 0.003).
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from client import ClientConfig, PSClient
from client.predict import PredictClient
from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.shard import Shard
from ps.store import Storage
from ps.table import spec_from_proto
from tests.fakes import InProcessTransport
from tests.integration.infer_helpers import raw_rows, requests_of, with_shared_context
from tests.integration.shards import shard_pid
from tests.profiles import long_run

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "faults" / "recording_worker.py"
BATCH = 1024
EVERY = 8  # steps between the worker's checkpoints


def launch_command(root: Path, samples: int, followers: bool) -> list[str]:
    return [
        sys.executable,
        "-m",
        "deploy.launch",
        "--shards=2",
        "--max-restarts=2",
        f"--log-dir={root / 'launch'}",
        f"--shard-arg=--data-dir={root.parent / 'data'}/shard-{{shard}}",
        "--shard-arg=--durability=every-push",
        "--shard-arg=--reshard-settle-s=2",
        *(["--followers"] if followers else []),
        "--",
        "python",
        str(WORKER),
        "--mode=pipelined",
        f"--train-samples={samples}",
        "--eval-samples=10000",
        f"--batch-size={BATCH}",
        f"--checkpoint-every={EVERY}",
        "--progress=false",
        "--seed=3",
        f"--output-dir={root / 'run'}",
    ]


@dataclass
class Run:
    """One ``ps-launch`` of the recording worker; its records stream to ``root/pushes``.
    With ``held`` the worker, once trained, waits for ``finish`` before it exits (and the
    launch stops its shards): what the test does last never races the end of training."""

    root: Path
    samples: int
    followers: bool = False
    held: bool = False
    proc: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        (self.root / "pushes").mkdir(parents=True)
        env = dict(os.environ, RECORD_STREAM=str(self.root / "pushes"))
        if self.held:
            env["RECORD_HOLD"] = str(self.root / "release")
        self.log = (self.root / "launch.log").open("w")
        command = launch_command(self.root, self.samples, self.followers)
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def launch(self) -> Path:
        return self.root / "launch"

    def text(self) -> str:
        return (self.root / "launch.log").read_text()

    def acks(self) -> list[tuple[int, float]]:
        """(seq, time) of each push acknowledged so far, in order."""
        path = self.root / "pushes" / "acks.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(int(s), float(t)) for s, t in (line.split() for line in lines if line.count(" ") == 1)]

    def training(self) -> bool:
        """True until the worker trained all its samples (a held one then waits for ``finish``)."""
        return self.proc.poll() is None and not (self.root / "release.trained").exists()

    def wait_steps(self, steps: int, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.acks()) < steps:
            assert self.training(), f"training ended before step {steps}: raise the samples\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)

    def newest_checkpoint(self) -> int:
        steps = [int(p.name[11:20]) for p in self.launch.glob("checkpoints/*/checkpoint-*.pt")]
        return max(steps, default=-1)

    def worker_pids(self) -> list[int]:
        needle = f"--output-dir={self.root / 'run'}".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                state = (proc / "stat").read_text().split(") ")[-1][:1]
            except OSError:
                continue
            if (
                needle in argv
                and str(WORKER).encode() in argv
                and state not in "ZX"
                and not {b"deploy.workers", b"deploy.launch"} & set(argv)
            ):
                pids.append(int(proc.name))
        # The worker itself, not processes it started (their parent is among them).
        return [p for p in pids if _parent(p) not in pids]

    def finish(self, timeout_s: float = 1800) -> dict[str, Any]:
        (self.root / "release").touch()
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        assert code == 0, self.text()[-4000:]
        metrics: dict[str, Any] = json.loads((self.root / "run" / "metrics.json").read_text())
        return metrics


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


class Scale:
    """``ps-launch --scale`` in a thread: when it started and ended, what it printed."""

    def __init__(self, run: Run, to: int, *extra: str) -> None:
        self.to, self.lines = to, []
        self.started, self.ended = time.monotonic(), 0.0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", "--scale", str(run.launch), "--to", str(to), *extra],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
        self.proc.wait()
        self.ended = time.monotonic()

    def wait_for(self, text: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None or self._reader.is_alive(), "\n".join(self.lines)
            assert time.monotonic() < deadline, "\n".join(self.lines)
            time.sleep(0.01)

    def finish(self) -> None:
        self._reader.join(900)
        assert self.proc.returncode == 0, "\n".join(self.lines)


class PredictLoad:
    """Predict requests to ps-infer in a loop, from a thread: each success's time, each failure."""

    def __init__(self, address: str) -> None:
        sizes = [16] * 64
        ids, counts = raw_rows(sum(sizes), seed=4)
        with_shared_context(ids, counts, sizes)
        self.requests = requests_of(ids, counts, sizes)
        self.client = PredictClient(address)
        self.done: list[float] = []
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for request in itertools.cycle(self.requests):
            if self._stop.is_set():
                return
            try:
                self.client.predict(*request, timeout_s=30)
                self.done.append(time.monotonic())
            except Exception as exc:  # counted, and the test fails on it
                self.failures.append(exc)
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


def start_infer(model: Path, serving: str, root: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = root / "infer.port"
    log = (root / "infer.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker.serving",
            f"--model={model}",
            f"--ps={serving}",
            "--listen=127.0.0.1:0",
            f"--port-file={port_file}",
            "--wait-s=120",
            "--threads=1",
            "--drain-s=0",  # stopped at the end, with nobody to move away
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (root / "infer.log").read_text()[-3000:]
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


# -- the replay ----------------------------------------------------------------------------


def records(stream: Path) -> list[list[tuple[Any, ...]]]:
    """Each worker process's records, processes in the order they started (a killed one's
    last record may be cut short: reading stops there)."""
    out = []
    for path in sorted(stream.glob("*.pkl"), key=lambda p: float(p.name.split("-")[0])):
        items = []
        with path.open("rb") as f:
            while True:
                try:
                    items.append(pickle.load(f))
                except (EOFError, pickle.UnpicklingError, ValueError, AttributeError):
                    break
        out.append(items)
    return out


Push = dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]]


def pushes_of(stream: Path) -> tuple[list[tuple[str, int, dict[str, Any]]], list[list[Push]], int]:
    """The tables created, and for each seq in order the pushes that may have been applied:
    one when its first send was acknowledged, two (the first send and the one after the
    resume) when the worker died before it saw the first acknowledged. And how many
    acknowledged sends the shards must have taken as duplicates."""
    tables: list[tuple[str, int, dict[str, Any]]] = []
    sends: dict[int, list[tuple[Push, bool]]] = {}
    for items in records(stream):
        acked = {item[1] for item in items if item[0] == "ack"}
        for item in items:
            if item[0] == "table" and item[1] not in [t[0] for t in tables]:
                tables.append((item[1], item[2], item[3]))
            elif item[0] == "send":
                sends.setdefault(item[1], []).append((item[2], item[1] in acked))
    choices, duplicates = [], 0
    for seq in sorted(sends):
        tries = sends[seq]
        first_acked = next((i for i, (_, ok) in enumerate(tries) if ok), None)
        assert first_acked is not None, f"seq {seq} was never acknowledged"
        duplicates += sum(ok for _, ok in tries[first_acked + 1 :])
        choices.append([tries[0][0]] if first_acked == 0 else [tries[0][0], tries[first_acked][0]])
    return tables, choices, duplicates


def twin_rows(runs: list[Path], keys: dict[str, npt.NDArray[np.int64]]) -> list[dict[str, npt.NDArray[np.float32]]]:
    """The rows of ``keys`` in in-process twins that applied the pushes of ``runs`` in order,
    one twin per way the uncertain seqs may have gone."""
    plans = [pushes_of(run) for run in runs]
    tables = [t for p in plans for t in p[0]]
    steps = [c for p in plans for c in p[1]]
    uncertain = [i for i, c in enumerate(steps) if len(c) > 1]
    assert len(uncertain) <= 3, f"{len(uncertain)} uncertain seqs: more than the pipeline holds at a kill"
    out = []
    for pick in itertools.product(*[range(len(steps[i])) for i in uncertain]):
        chosen = dict(zip(uncertain, pick))
        shards = [Shard(0, 2), Shard(1, 2)]
        twin = PSClient(["inproc:0", "inproc:1"], ClientConfig(tune_malloc=False), transport=InProcessTransport(shards))
        with twin:
            done = set()
            for name, dim, options in tables:
                if name not in done:
                    twin.create_table(name, dim, **options)
                    done.add(name)
            for i, step in enumerate(steps):
                twin.push_many(step[chosen.get(i, 0)])
            out.append(twin.lookup_many(keys))
    return out


def stored_rows(data: Path, shards: int) -> list[dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]]]:
    """Each shard's stored (keys, values) per table, read from its data dir."""
    out = []
    for i in range(shards):
        with Storage(data / f"shard-{i}", shard=-1, num_shards=0, read_only=True) as st:
            tables = {}
            for name, raw in st.specs().items():
                spec = spec_from_proto(pb.TableSpec.FromString(raw))
                parts = list(st.table(name, spec.row_format).scan())
                keys = np.concatenate([p.keys for p in parts] or [np.empty(0, np.int64)])
                values = np.concatenate([p.values for p in parts] or [np.empty((0, spec.dim), np.float32)])
                tables[name] = (keys, values)
        out.append(tables)
    return out


def pushed_keys(runs: list[Path]) -> dict[str, npt.NDArray[np.int64]]:
    keys: dict[str, list[npt.NDArray[np.int64]]] = {}
    for run in runs:
        for items in records(run):
            for item in items:
                if item[0] == "send":
                    for t, (k, _) in item[2].items():
                        keys.setdefault(t, []).append(k)
    return {t: np.unique(np.concatenate(k)) for t, k in keys.items()}


# -- the test ------------------------------------------------------------------------------


def slowest_step(acks: list[tuple[int, float]], start: float, end: float) -> float:
    """The longest wait between two acknowledged pushes that overlaps [start, end]."""
    times = [t for _, t in acks]
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=0.0)


@pytest.mark.slow
def test_the_cluster_grows_and_shrinks_under_training_and_serving(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    long = long_run(request.config)
    # The moves and the kills follow each other as fast as they go; the run must outlast them.
    warm_samples, samples = (100_000, 2_000_000) if long else (20_000, 500_000)
    warm = Run(tmp_path / "a" / "warm", warm_samples)
    warm.finish()
    run = Run(tmp_path / "a" / "main", samples, followers=True, held=True)
    moves: list[Scale] = []
    infer: subprocess.Popen[bytes] | None = None
    load: PredictLoad | None = None
    try:
        run.wait_steps(1)
        serving = (run.launch / "serving-addresses").read_text().strip()
        infer, address = start_infer(warm.root / "run", serving, tmp_path)
        load = PredictLoad(address)
        run.wait_steps(2 * EVERY)
        moves.append(Scale(run, 3))
        moves[-1].finish()
        moves.append(Scale(run, 4, "--max-rows-per-s=20000"))  # paced: the kill lands while rows move
        moves[-1].wait_for("resharding from 3 to 4")
        time.sleep(0.5)
        victim = shard_pid(run.launch, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        moves[-1].finish()
        next_checkpoint = run.newest_checkpoint() + 1
        while run.newest_checkpoint() < next_checkpoint:
            assert run.training(), "training ended before the worker could be killed: raise the samples"
            time.sleep(0.02)
        time.sleep(0.3)  # a few steps past the checkpoint: the resumed worker sends them again
        (worker,) = run.worker_pids()
        os.kill(worker, signal.SIGKILL)
        run.wait_steps(len(run.acks()) + 2 * EVERY)  # the resumed worker trains on
        moves.append(Scale(run, 3))
        moves[-1].finish()
        # A ps-infer started now, given the serving shards the model was trained beside, serves.
        (tmp_path / "late").mkdir()
        late, late_address = start_infer(warm.root / "run", serving, tmp_path / "late")
        with PredictClient(late_address) as late_client:
            assert late_client.predict(*load.requests[0], timeout_s=30).shape == (16,)
        late.send_signal(signal.SIGTERM)
        assert late.wait(60) == 0
        load.stop()  # before training ends: the launch stops the serving shards with it
        metrics = run.finish()
    finally:
        if load is not None:
            load.stop()
        if infer is not None:
            infer.send_signal(signal.SIGTERM)
            infer.wait(60)
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    text = run.text()
    assert "restarting it on the same address" in text, "the shard killed during the move came back"
    assert "resuming from" in text and "failed (exitcode: -9)" in text, text[-4000:]
    assert infer.returncode == 0, (tmp_path / "infer.log").read_text()[-3000:]

    # Predict never failed, and answered during every move.
    assert load.failures == [], load.failures[:3]
    for move in moves:
        assert any(move.started <= t <= move.ended for t in load.done), f"no Predict answered during {move.lines}"

    # Each pushed key on exactly one shard: its owner among 3; the retired shard holds nothing.
    streams = [warm.root / "pushes", run.root / "pushes"]
    keys = pushed_keys(streams)
    stored = stored_rows(tmp_path / "a" / "data", 4)
    assert all(keys.size == 0 for keys, _ in stored[3].values()), "the retired shard still holds rows"
    found: dict[str, npt.NDArray[np.float32]] = {}
    for table, want in keys.items():
        values = np.full((want.size, stored[0][table][1].shape[1]), np.nan, np.float32)
        seen = np.zeros(want.size, np.int64)
        for i in range(3):
            k, v = stored[i][table]
            assert (shard_of(k, 3) == i).all(), f"shard {i} holds keys of {table!r} it does not own"
            at = np.searchsorted(want, k)
            mine = (at < want.size) & (want[np.minimum(at, want.size - 1)] == k)
            values[at[mine]] = v[mine]
            seen[at[mine]] += 1
        assert (seen == 1).all(), f"{table!r}: {int((seen == 0).sum())} pushed keys stored nowhere"
        found[table] = values

    # Every row: the twin's, which applied each acknowledged push once.
    twins = twin_rows(streams, keys)
    rows = differ = 0
    for table, want in keys.items():
        ok = np.zeros(want.size, bool)
        for twin in twins:
            ok |= (twin[table] == found[table]).all(axis=1)
        rows += want.size
        differ += int((~ok).sum())
    _, _, duplicates = pushes_of(run.root / "pushes")
    acks = run.acks()
    report = ", ".join(
        f"to {m.to}: {m.ended - m.started:.1f} s, slowest step {slowest_step(acks, m.started, m.ended):.2f} s"
        for m in moves
    )
    steady = np.median(np.diff([t for _, t in acks])) if len(acks) > 1 else 0.0
    print(
        f"moves: {report}; median step {steady:.3f} s; acknowledged pushes {len(acks)} (sent again after the "
        f"resume and taken as duplicates: {duplicates}); rows compared {rows}, differing {differ}; twins "
        f"{len(twins)}; Predict answered {len(load.done)}, failed {len(load.failures)}; AUC "
        f"{metrics['final']['auc']:.4f}"
    )
    assert differ == 0, f"{differ} of {rows} rows differ from every replay of the acknowledged pushes"
    if long:
        fixed_warm = Run(tmp_path / "b" / "warm", warm_samples)
        fixed_warm.finish()
        fixed = Run(tmp_path / "b" / "main", samples).finish()
        print(
            f"AUC through the moves {metrics['final']['auc']:.4f}, on 2 shards throughout {fixed['final']['auc']:.4f}"
        )
        assert abs(metrics["final"]["auc"] - fixed["final"]["auc"]) <= 0.003
