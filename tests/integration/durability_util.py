"""Helpers for the durability tests: raw pushes with chosen ``(client_id, seq)``,
bit-exact push accounting, and shard processes started with a file-size limit.

Every push in these tests adds exactly +1 to each row it touches: the table uses
SGD with lr=1 on zero-initialised rows and every gradient is -1, so a row holds the
number of applied pushes that touched it (exact in float32 far beyond the counts
used here). ``keys_of(client, seq)`` is a pure function, so a push can be resent
after a restart and the expected rows recomputed from a list of ``(client, seq)``.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Self

import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy import local
from deploy.local import REPO, ShardProcess
from protos import ps_pb2 as pb
from protos import wire
from protos.rpc import child_command

__all__ = [
    "DIM",
    "NUM_KEYS",
    "TABLE",
    "Pusher",
    "counts_of",
    "health_status",
    "keys_of",
    "run_to_exit",
    "set_file_size_limit",
    "spawn_shard",
    "terminate",
]

TABLE = "t"
DIM = 4
NUM_KEYS = 64
KEYS_PER_PUSH = 4
_PUSH = "/ps.v1.ParameterServer/Push"


def keys_of(client: str, seq: int) -> npt.NDArray[np.int64]:
    """The distinct keys push ``(client, seq)`` touches (a pure function of both)."""
    rng = np.random.default_rng([*client.encode(), seq])
    return np.sort(rng.choice(NUM_KEYS, size=KEYS_PER_PUSH, replace=False)).astype(np.int64)


def counts_of(pushes: Iterable[tuple[str, int]]) -> npt.NDArray[np.float32]:
    """Expected ``[NUM_KEYS]`` row value (every column) after exactly ``pushes`` applied once."""
    counts = np.zeros(NUM_KEYS, dtype=np.float32)
    for client, seq in pushes:
        counts[keys_of(client, seq)] += 1
    return counts


class Pusher:
    """Sends raw ``Push`` RPCs for ``keys_of(client, seq)`` with gradient -1 to one shard of 1."""

    def __init__(self, address: str, table: str = TABLE, dim: int = DIM) -> None:
        self._channel = grpc.insecure_channel(address)
        self._push = self._channel.unary_unary(_PUSH, None, pb.PushResponse.FromString)
        self._table = table
        self._dim = dim

    def push(self, client: str, seq: int, keys: npt.NDArray[np.int64] | None = None, timeout_s: float = 20.0) -> bool:
        """``applied`` of the reply; raises ``grpc.RpcError`` when the shard refuses or dies."""
        k = keys_of(client, seq) if keys is None else keys
        grads = np.full((k.shape[0], self._dim), -1.0, dtype=np.float32)
        request = wire.encode_push_request([(self._table, k, grads, wire.FLOAT32)], 1, client, seq, 0)
        reply: pb.PushResponse = self._push(request, timeout=timeout_s)
        return bool(reply.applied)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def health_status(address: str, service: str) -> int:
    """``grpc.health.v1`` status of ``service`` on ``address`` (a ``HealthCheckResponse`` enum)."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def spawn_shard(
    root: Path, name: str, *args: str, fsize_limit_bytes: int | None = None, timeout_s: float = 60.0
) -> ShardProcess:
    """``deploy.local.start_shard`` (shard 0 of 1, files under ``root/name``), optionally
    under ``RLIMIT_FSIZE``; raises ``ShardStartError`` with the log tail if it exits first.

    Only the soft limit is set, so ``set_file_size_limit`` can lift it later (the
    "disk" gets space again) without privileges."""

    return local.start_shard(0, 1, root / name, *args, timeout_s=timeout_s, file_size_limit_bytes=fsize_limit_bytes)


def set_file_size_limit(pid: int, limit_bytes: int | None) -> None:
    """Set the running process ``pid``'s soft ``RLIMIT_FSIZE`` (None: unlimited, up to its
    hard limit). Linux, same user or root."""
    hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
    soft = hard if limit_bytes is None else limit_bytes
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


def terminate(shard: ShardProcess, timeout_s: float = 60.0) -> int:
    """SIGTERM and wait for the exit code (killed, and -9, after ``timeout_s``)."""
    if shard.proc.poll() is None:
        shard.proc.send_signal(signal.SIGTERM)
    try:
        return shard.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        shard.proc.kill()
        shard.proc.wait()
        return -9


def run_to_exit(root: Path, *args: str, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run ``python -m ps --listen=127.0.0.1:0 ARGS`` expecting it to exit by itself;
    returns (exit code, stdout+stderr); (-9, output so far) if it had to be killed
    after ``timeout_s``."""
    try:
        done = subprocess.run(
            child_command(
                [sys.executable, "-m", "ps", "--listen=127.0.0.1:0", f"--port-file={root / 'port.refused'}", *args]
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=root,
            env=_env(),
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if exc.stdout else ""
        return -9, f"(still running after {timeout_s}s, killed)\n{out}"
    return done.returncode, done.stdout.decode(errors="replace")
