"""Real ``python -m ps`` shard processes for tests, via ``deploy.local`` (failures fail the test)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deploy import local
from deploy.local import ShardProcess as RunningShard
from deploy.local import ShardStartError

__all__ = ["RunningShard", "shard_pid", "start_shard", "stop_shard"]


def start_shard(
    i: int, n: int, root: Path, *extra: str, timeout_s: float = 60.0, listen: str = "127.0.0.1:0"
) -> RunningShard:
    """Start shard ``i`` of ``n``; returns once it wrote its real port to its port file.

    A restart on a fixed port (``listen`` not ending in ``:0``) tries again for a few
    seconds while that port is still taken: a client reconnecting to a stopped shard on
    loopback can, rarely, get that very port as its own source port for a moment.
    """
    tries = 1 if listen.endswith(":0") else 10
    for attempt in range(tries):
        try:
            return local.start_shard(i, n, root, *extra, timeout_s=timeout_s, listen=listen)
        except ShardStartError as exc:
            if attempt + 1 == tries or "cannot listen on" not in str(exc):
                pytest.fail(str(exc))
            time.sleep(0.5)
    raise AssertionError("unreachable")


def stop_shard(shard: RunningShard, timeout_s: float = 30.0) -> None:
    """Stop it (``deploy.local.stop_shard``) and wait; fails the test (with the log tail) unless it exits 0."""
    try:
        local.stop_shard(shard, timeout_s)
    except ShardStartError as exc:
        pytest.fail(str(exc))


def shard_pid(launch_dir: Path, index: int) -> int | None:
    """The pid of the live shard process whose port file is ``launch_dir/port.<index>``."""
    needle = f"--port-file={launch_dir / f'port.{index}'}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if needle in cmdline and b"ps" in cmdline and state != "Z":
            return int(proc.name)
    return None
