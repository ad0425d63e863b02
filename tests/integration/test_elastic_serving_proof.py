"""The elastic serving proof: ``ps-infer`` under a steady Predict load while serving replicas
join, drain and die, with no failed request.

A DLRM is trained against 2 training shards; serving replicas follow them
(``deploy.replicas.ServingReplicas``, 1 per shard at first) and ``ps-infer --ps-file``
follows their addresses file. Under a Predict loop: a second replica of each shard
joins, then a third; the first replica of shard 0 is removed (SIGTERM: it drains, then
exits 0) and one of shard 1 is ``kill -9``ed. Then, with hedging on, a replica is
stopped (SIGSTOP) and resumed. Checked: no Predict failed; the scores of one fixed
request are the same bits after every event (every replica holds the training
shards' rows, and a replica not loaded yet never answers); each new replica's own
Stats show lookups. p50/p99 of the Predict calls in each phase are printed
(``benchmarks/bench_serving.py --elastic`` measures them against a fixed replica set).
``-m slow`` holds each phase longer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import PredictClient, PSClient
from deploy.local import LocalCluster
from deploy.replicas import ServingReplicas
from tests.integration.infer_helpers import raw_rows, requests_of, with_shared_context
from tests.profiles import long_run
from worker.trainer import TrainerConfig, train

REPO = Path(__file__).resolve().parents[2]


def predict_requests() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """32 requests of 16 candidates, each with one context."""
    sizes = [16] * 32
    ids, counts = raw_rows(sum(sizes), seed=4)
    with_shared_context(ids, counts, sizes)
    return requests_of(ids, counts, sizes)


class Load:
    """Predict calls in a loop on a thread: when each started and how long it took, each failure."""

    def __init__(self, address: str) -> None:
        self.requests = predict_requests()
        self.client = PredictClient(address)
        self.calls: list[tuple[float, float]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.client.predict(*self.requests[i % len(self.requests)], timeout_s=30)
                self.calls.append((started, time.monotonic() - started))
            except Exception as exc:  # every failure fails the test
                self.failures.append(repr(exc))
            i += 1

    def phase(self, name: str, began: float) -> None:
        took = np.array([d for s, d in self.calls if s >= began]) * 1000
        assert took.size, f"{name}: no Predict call finished"
        p50, p99 = np.percentile(took, [50, 99])
        print(f"{name:<28} {took.size:>6} calls  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    root = tmp_path_factory.mktemp("elastic-serving")
    with LocalCluster(2, root=root / "shards") as shards:
        config = TrainerConfig(
            train_samples=4096, eval_samples=512, batch_size=512, progress=False, output_dir=root / "run"
        )
        train(config, shards.addresses)
        yield shards, root / "run"


def start_infer(run: Path, ps_file: Path, root: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file, log = root / "infer.port", root / "infer.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.serving",
                f"--model={run}",
                f"--ps-file={ps_file}",
                "--listen=127.0.0.1:0",
                f"--port-file={port_file}",
                "--hedge-after-ms=50",
                "--wait-s=120",
                "--threads=1",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 180
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def served(address: str) -> int:
    with PSClient([address]) as client:
        return sum(t["lookups"] for t in client.admin.stats()[0]["tables"])


@pytest.mark.slow
def test_replicas_join_drain_die_and_stall_under_predict_load_with_no_failed_request(
    cluster: tuple[LocalCluster, Path], tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    hold_s = 8.0 if long_run(pytestconfig) else 1.5  # how long the load runs in each phase
    shards, run = cluster
    with ServingReplicas(shards.addresses, tmp_path / "serving") as replicas, contextlib.ExitStack() as stack:
        infer, address = start_infer(run, replicas.addresses_file, tmp_path)
        try:
            probe = predict_requests()[0]
            with PredictClient(address) as client:
                expected = client.predict(*probe)

            def same_scores() -> None:
                with PredictClient(address) as client:
                    np.testing.assert_array_equal(client.predict(*probe), expected)

            load = Load(address)
            stack.callback(load.stop)
            began = time.monotonic()
            time.sleep(hold_s)
            load.phase("1 replica per shard", began)
            for n in (2, 3):
                began = time.monotonic()
                added = [replicas.add(s) for s in range(2)]
                deadline = time.monotonic() + 60
                while not all(served(r.address) for r in added):  # each takes lookups once ready
                    assert time.monotonic() < deadline, [served(r.address) for r in added]
                    time.sleep(0.1)
                print(
                    f"replicas {n} per shard: the new ones looked rows up {time.monotonic() - began:.1f} s after start"
                )
                time.sleep(hold_s)
                load.phase(f"adding to {n} per shard", began)
                same_scores()
            began = time.monotonic()
            assert replicas.remove(replicas.addresses[0][0]) == 0  # SIGTERM: drains, exits 0
            time.sleep(hold_s)
            load.phase("SIGTERM one of shard 0", began)
            same_scores()
            began = time.monotonic()
            assert replicas.remove(replicas.addresses[1][0], kill=True) == -signal.SIGKILL
            time.sleep(hold_s)
            load.phase("kill -9 one of shard 1", began)
            same_scores()
            stalled = replicas.replicas[0][0].proc.pid
            began = time.monotonic()
            os.kill(stalled, signal.SIGSTOP)  # hedged reads go round it
            try:
                time.sleep(hold_s)
                load.phase("SIGSTOP one of shard 0", began)
                same_scores()
            finally:
                os.kill(stalled, signal.SIGCONT)
            began = time.monotonic()
            time.sleep(hold_s)
            load.phase("after", began)
            load.stop()
            assert load.failures == []
            assert len(load.calls) > 50
        finally:
            infer.send_signal(signal.SIGINT)
            assert infer.wait(60) == 0
