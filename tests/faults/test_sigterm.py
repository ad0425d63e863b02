"""SIGTERM a shard in the middle of a load, restart it on its data dir, and lose nothing.

Five threads keep calling one shard (``--data-dir``, the default ``interval:5``
durability, so the final flush at shutdown is what keeps the last pushes): three through
``PSClient`` (it retries through the restart; none of their calls may fail), two with raw
calls that record every attempt's status. The shard gets SIGTERM, must exit 0, and is
started again on the same address and data dir while the load goes on.

Pushes go to a counting table (SGD, lr 1, zero rows, gradient -1, fresh keys for each
push), so after the restart a row tells how many times its push was applied. Checked:
a raw attempt, whether it started before the signal or after, ends OK or with a status
the client retries: UNAVAILABLE (the shard refusing it while it stops: nothing applied)
or CANCELLED (perhaps applied: resent with the same seq until acknowledged); every
acknowledged push is applied exactly once, across the restart too; every push refused
with UNAVAILABLE is not applied at all (the raw threads send the next push with a new
seq, so a refusal that was applied after all would show).

A plain run stops and restarts the shard once; ``pytest -m slow`` 20 times.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from client import ClientConfig, PSClient, PSError
from protos import ps_pb2 as pb
from protos import wire
from tests.integration.shards import RunningShard, start_shard, stop_shard
from tests.profiles import long_run

TABLE, DIM, KEYS_PER_PUSH = "count", 8, 4
PATH = "/ps.v1.ParameterServer/"
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]


@dataclass(frozen=True)
class Attempt:
    method: str
    started: float
    ended: float
    code: str
    details: str = ""


@dataclass
class Load:
    """What the load threads did; ``keys()`` hands out fresh keys for each push."""

    acked: list[npt.NDArray[np.int64]] = field(default_factory=list)  # keys of acknowledged pushes
    refused: list[npt.NDArray[np.int64]] = field(default_factory=list)  # keys of pushes refused with UNAVAILABLE
    attempts: list[Attempt] = field(default_factory=list)  # raw calls
    client_errors: list[str] = field(default_factory=list)  # PSClient calls that raised
    client_calls: int = 0
    resent: int = 0  # raw pushes resent after an ambiguous failure (CANCELLED)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _next: itertools.count[int] = field(default_factory=itertools.count)

    def keys(self) -> npt.NDArray[np.int64]:
        with self.lock:
            first = next(self._next) * KEYS_PER_PUSH
        return np.arange(first, first + KEYS_PER_PUSH, dtype=np.int64)

    def pushed(self) -> npt.NDArray[np.int64]:
        with self.lock:
            return np.concatenate(self.acked) if self.acked else np.zeros(0, np.int64)


def client_load(address: str, load: Load, rng: np.random.Generator) -> None:
    config = ClientConfig(deadline_s=30, backoff_initial_s=0.02, backoff_max_s=0.2, tune_malloc=False)
    grads = np.full((KEYS_PER_PUSH, DIM), -1.0, np.float32)
    with PSClient([address], config) as ps:
        ps.create_table(TABLE, DIM, optimizer="sgd", initializer="zeros", lr=1.0)
        while not load.stop.is_set():
            keys = load.keys()
            try:
                ps.push(TABLE, keys, grads)
                with load.lock:
                    load.acked.append(keys)
                pushed = load.pushed()
                probe = np.concatenate([rng.choice(pushed, 16), rng.integers(1 << 40, 1 << 41, 16)])
                ps.lookup(TABLE, probe)
            except PSError as exc:
                with load.lock:
                    load.client_errors.append(f"{type(exc).__name__}: {exc}")
            with load.lock:
                load.client_calls += 2


def raw_load(address: str, load: Load, client_id: str) -> None:
    """Raw pushes and lookups. A push refused with UNAVAILABLE is given up (it must not have
    been applied); one that ended otherwise (CANCELLED) may have been applied, so it is
    resent with the same seq until acknowledged, as ``PSClient`` does (then: applied once)."""
    grads = np.full((KEYS_PER_PUSH, DIM), -1.0, np.float32)
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        push, lookup = (channel.unary_unary(PATH + m, None, None) for m in ("Push", "Lookup"))
        for seq in itertools.count(1):
            if load.stop.is_set():
                return
            keys = load.keys()
            request = wire.encode_push_request([(TABLE, keys, grads, wire.FLOAT32)], 1, client_id, seq, 0)
            code = first = _attempt(load, "Push", push, request)
            resend_until = time.monotonic() + 30
            while code != "OK" and first != "UNAVAILABLE" and time.monotonic() < resend_until:
                time.sleep(0.02)
                code = _attempt(load, "Push", push, request)
            with load.lock:
                if code == "OK":
                    load.acked.append(keys)
                    load.resent += first != "OK"
                elif first == "UNAVAILABLE":
                    load.refused.append(keys)
                else:
                    load.client_errors.append(f"raw push {client_id}/{seq}: {first}, then {code} for 30 s")
            probe = pb.LookupRequest(
                entries=[pb.LookupEntry(table=TABLE, keys=wire.encode_keys(keys))], num_shards=1, shard=0
            ).SerializeToString()
            _attempt(load, "Lookup", lookup, probe)
            if code != "OK":
                time.sleep(0.02)


def _attempt(load: Load, method: str, call: grpc.UnaryUnaryMultiCallable, request: bytes) -> str:
    started = time.monotonic()
    details = ""
    try:
        call(request, timeout=10)
        code = "OK"
    except grpc.RpcError as exc:
        code, details = exc.code().name, str(exc.details())
    with load.lock:
        load.attempts.append(Attempt(method, started, time.monotonic(), code, details))
    return code


@pytest.mark.slow
def test_sigterm_under_load_exits_0_and_loses_nothing(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    rounds = 20 if long_run(request.config) else 1
    data = tmp_path / "data"
    shard: RunningShard = start_shard(0, 1, tmp_path, f"--data-dir={data}")
    address = shard.address
    load = Load()
    threads = [threading.Thread(target=client_load, args=(address, load, np.random.default_rng(i))) for i in range(3)]
    threads += [threading.Thread(target=raw_load, args=(address, load, f"raw-{i}")) for i in range(2)]
    terms: list[float] = []
    stop_s: list[float] = []
    restart_s: list[float] = []
    try:
        with PSClient([address]) as ps:
            ps.create_table(TABLE, DIM, optimizer="sgd", initializer="zeros", lr=1.0)
        for t in threads:
            t.start()
        for _ in range(rounds):
            time.sleep(1.5)
            terms.append(time.monotonic())
            shard.proc.send_signal(signal.SIGTERM)
            code = shard.proc.wait(60)
            stop_s.append(time.monotonic() - terms[-1])
            assert code == 0, f"shard exited {code} on SIGTERM:\n{shard.log_tail()}"
            started = time.monotonic()
            # The restart keeps the address: the clients find it again.
            shard = start_shard(0, 1, tmp_path, f"--data-dir={data}", listen=address)
            restart_s.append(time.monotonic() - started)
        time.sleep(1.5)
    finally:
        load.stop.set()
        for t in threads:
            if t.is_alive():
                t.join(60)
    try:
        with PSClient([address]) as ps:
            acked, refused = load.pushed(), np.concatenate(load.refused or [np.zeros(0, np.int64)])
            rows = ps.lookup(TABLE, np.concatenate([acked, refused]))
    finally:
        stop_shard(shard)
    applied = rows[:, 0]
    assert (rows == applied[:, None]).all(), "a push was applied to some columns only"
    applied_acked, applied_refused = applied[: acked.shape[0]], applied[acked.shape[0] :]

    def spans(a: Attempt) -> bool:
        return any(a.started < t < a.ended for t in terms)

    codes = Counter(a.code for a in load.attempts)
    spanning = Counter(f"{a.method} {a.code}" for a in load.attempts if spans(a))
    refusals = Counter(a.details.splitlines()[0][:80] for a in load.attempts if a.code != "OK")
    print(
        f"rounds {rounds}: stop s {[round(s, 2) for s in stop_s]}, restart s {[round(s, 2) for s in restart_s]}, "
        f"client calls {load.client_calls} (failed {len(load.client_errors)}), raw attempts {dict(codes)}, "
        f"in flight across a SIGTERM {dict(spanning)}, refusals {dict(refusals)}, "
        f"pushes acknowledged {acked.shape[0] // KEYS_PER_PUSH} (raw ones resent {load.resent}), refused {refused.shape[0] // KEYS_PER_PUSH}, "
        f"rows compared {rows.shape[0]}, acknowledged rows not applied once {int((applied_acked != 1).sum())}, "
        f"refused rows applied {int((applied_refused != 0).sum())}"
    )
    assert not load.client_errors, load.client_errors[:5]
    retryable = {"OK", "UNAVAILABLE", "CANCELLED"}  # what PSClient retries (pushes: with the same seq)
    assert set(codes) <= retryable, [a for a in load.attempts if a.code not in retryable][:10]
    assert load.client_calls > 0 and codes["OK"] > 0
    lost, twice = np.flatnonzero(applied_acked < 1), np.flatnonzero(applied_acked > 1)
    assert lost.size == 0, f"acknowledged pushes lost, keys {acked[lost][:10].tolist()}"
    assert twice.size == 0, f"acknowledged pushes applied more than once, keys {acked[twice][:10].tolist()}"
    ghost = np.flatnonzero(applied_refused != 0)
    assert ghost.size == 0, f"pushes refused with UNAVAILABLE were applied, keys {refused[ghost][:10].tolist()}"
