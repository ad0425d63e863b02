"""Start and stop real ``python -m ps`` shard processes on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RunningShard:
    index: int
    address: str
    proc: subprocess.Popen[bytes]
    log: Path


def start_shard(i: int, n: int, root: Path, *extra: str, timeout_s: float = 60.0) -> RunningShard:
    """Start shard ``i`` of ``n``; returns once it wrote its real port to its port file."""
    port_file, log = root / f"port.{i}", root / f"shard.{i}.log"
    port_file.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ps", f"--shard={i}", f"--num-shards={n}", "--listen=127.0.0.1:0",
         f"--port-file={port_file}", *extra],  # fmt: skip
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd=root,
        env=env,
    )
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"shard {i} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return RunningShard(i, f"127.0.0.1:{port_file.read_text().strip()}", proc, log)


def stop_shard(shard: RunningShard, timeout_s: float = 30.0) -> None:
    """SIGTERM and wait; fails the test (with the log tail) unless the shard exits 0."""
    if shard.proc.poll() is None:
        shard.proc.send_signal(signal.SIGTERM)
    try:
        code = shard.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        shard.proc.kill()
        shard.proc.wait()
        pytest.fail(f"shard {shard.index} ignored SIGTERM for {timeout_s}s:\n{shard.log.read_text()[-3000:]}")
    if code != 0:
        pytest.fail(f"shard {shard.index} exited {code}:\n{shard.log.read_text()[-3000:]}")
