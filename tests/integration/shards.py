"""Real ``python -m ps`` shard processes for tests, via ``deploy.local`` (failures fail the test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy import local
from deploy.local import ShardProcess as RunningShard
from deploy.local import ShardStartError

__all__ = ["RunningShard", "shard_pid", "start_shard", "stop_shard"]


def start_shard(
    i: int, n: int, root: Path, *extra: str, timeout_s: float = 60.0, listen: str = "127.0.0.1:0"
) -> RunningShard:
    """Start shard ``i`` of ``n``; returns once it wrote its real port to its port file."""
    try:
        return local.start_shard(i, n, root, *extra, timeout_s=timeout_s, listen=listen)
    except ShardStartError as exc:
        pytest.fail(str(exc))


def stop_shard(shard: RunningShard, timeout_s: float = 30.0) -> None:
    """SIGTERM and wait; fails the test (with the log tail) unless the shard exits 0."""
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
