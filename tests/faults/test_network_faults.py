"""A faulty network between client and shard: delays, a black hole, resets, lost answers.

``PSClient`` talks to a real shard through ``FaultProxy`` (tests/faults/proxy.py) with a
short deadline and attempt timeout. In every mode each call must end within its
deadline (plus a little slack for a loaded 2-core machine); while the network is bad
calls fail with a retryable status, after switching back to ``pass`` they succeed
again. Pushes go to a counting table (SGD, lr 1, zero rows, gradient -1, each push its
own keys), so a row's value is the number of times its push was applied: an
acknowledged push must be there exactly once, one whose answer was dropped after the
shard got it exactly once too (its retries found it applied), and none ever twice.

A plain run goes through each mode once; ``pytest -m slow`` cycles through them in a
random order (the seed is printed) for about 5 minutes.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from client import ClientConfig, PSClient, PSError
from tests.faults.proxy import FaultProxy, Mode
from tests.integration.shards import RunningShard, start_shard, stop_shard
from tests.profiles import long_run

TABLE, DIM, KEYS_PER_PUSH = "count", 4, 8
DEADLINE_S, ATTEMPT_S = 1.5, 0.4
SLACK_S = 0.5  # past the deadline: the client's own scheduling on a loaded machine
FAILING = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # what a call may end with while the network is bad


@dataclass(frozen=True)
class Phase:
    mode: Mode
    delay_ms: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.mode} {self.delay_ms:g} ms" if self.mode == "delay" else self.mode

    @property
    def works(self) -> bool:
        """Calls succeed in this phase (a delay well inside the attempt timeout)."""
        return self.mode == "pass" or (self.mode == "delay" and 2 * self.delay_ms < 500 * ATTEMPT_S)


BAD = [Phase("delay", 1000), Phase("blackhole"), Phase("reset"), Phase("drop_response")]
GOOD = [Phase("pass"), Phase("delay", 50)]


@dataclass(frozen=True)
class Outcome:
    phase: str
    works: bool
    push: int | None  # the push's index (its keys), None for a lookup
    code: str  # "OK" or the status name
    seconds: float


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[RunningShard]:
    s = start_shard(0, 1, tmp_path)
    try:
        with PSClient([s.address]) as ps:
            ps.create_table(TABLE, DIM, optimizer="sgd", initializer="zeros", lr=1.0)
        yield s
    finally:
        stop_shard(s)


class Caller:
    """Pushes (each to keys of its own) and lookups through one client; thread-safe."""

    def __init__(self, client: PSClient) -> None:
        self.client = client
        self.outcomes: list[Outcome] = []
        self._next_push = 0
        self._lock = threading.Lock()

    def call(self, phase: Phase, kind: str) -> None:
        push = None
        if kind == "push":
            with self._lock:
                push, self._next_push = self._next_push, self._next_push + 1
        started = time.monotonic()
        try:
            if push is not None:
                keys = np.arange(push * KEYS_PER_PUSH, (push + 1) * KEYS_PER_PUSH)
                self.client.push(TABLE, keys, np.full((KEYS_PER_PUSH, DIM), -1.0, np.float32))
            else:
                self.client.lookup(TABLE, np.arange(64))
            code = "OK"
        except PSError as exc:
            code = exc.code.name
        with self._lock:
            self.outcomes.append(Outcome(phase.name, phase.works, push, code, time.monotonic() - started))

    @property
    def pushes(self) -> int:
        return self._next_push


def run_phase(proxy: FaultProxy, caller: Caller, phase: Phase, calls_per_thread: int, threads: int = 2) -> None:
    proxy.set_mode(phase.mode, phase.delay_ms)
    kinds = ["push", "lookup"] * calls_per_thread

    def work(t: int) -> None:
        for kind in kinds[t % 2 : t % 2 + calls_per_thread]:
            caller.call(phase, kind)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))


@pytest.mark.slow
def test_calls_end_in_time_and_pushes_apply_once_through_a_faulty_network(
    shard: RunningShard, request: pytest.FixtureRequest
) -> None:
    long = long_run(request.config)
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    config = ClientConfig(
        deadline_s=DEADLINE_S, attempt_timeout_s=ATTEMPT_S, backoff_initial_s=0.02, backoff_max_s=0.2, tune_malloc=False
    )
    with FaultProxy(shard.address) as proxy, PSClient([proxy.address], config) as client:
        client.create_table(TABLE, DIM, optimizer="sgd", initializer="zeros", lr=1.0)  # same spec: learns the dim
        caller = Caller(client)
        run_phase(proxy, caller, Phase("pass"), 4)
        ends = time.monotonic() + 300 if long else 0.0
        cycles, longest_delay_s = 0, 0.0
        while True:
            for i, bad in enumerate(rng.sample(BAD, len(BAD)) if long else BAD):
                if long and bad.mode == "delay":
                    bad = Phase("delay", rng.choice([600, 1000, 2500]))
                longest_delay_s = max(longest_delay_s, bad.delay_ms / 1000)
                run_phase(proxy, caller, bad, 2)
                if bad.mode == "delay":  # a connection's bytes arrive in order: the delayed ones land first
                    proxy.set_mode("pass")
                    proxy.wait_drained(2 * bad.delay_ms / 1000 + 10)
                run_phase(proxy, caller, rng.choice(GOOD) if long else GOOD[i % 2], 3)  # recovers
            cycles += 1
            if time.monotonic() >= ends:
                break
        proxy.set_mode("pass")
        proxy.wait_drained(2 * longest_delay_s + 10)
        counters = proxy.counters
    time.sleep(0.2)  # the shard has handled what the proxy forwarded last
    with PSClient([shard.address]) as direct:
        rows = direct.lookup(TABLE, np.arange(caller.pushes * KEYS_PER_PUSH)).reshape(caller.pushes, -1)
        duplicates = direct.admin.stats()[0]["duplicate_pushes"]
    applied = rows[:, 0]
    assert (rows == applied[:, None]).all(), "a push was applied to some of its rows only"

    outcomes = caller.outcomes
    by_phase: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_phase.setdefault(o.phase, Counter())[o.code] += 1
    slowest = max(o.seconds for o in outcomes)
    acked = [o.push for o in outcomes if o.push is not None and o.code == "OK"]
    print(
        f"seed {seed}, cycles {cycles}: calls {len(outcomes)}, by phase { ({k: dict(v) for k, v in by_phase.items()}) }, "
        f"slowest call {slowest:.2f} s (deadline {DEADLINE_S} s), pushes {caller.pushes} (acknowledged {len(acked)}), "
        f"rows compared {rows.shape[0] * KEYS_PER_PUSH}, times applied {dict(Counter(applied.astype(int).tolist()))}, "
        f"duplicates skipped by the shard {duplicates}, proxy {counters}"
    )

    late = [o for o in outcomes if o.seconds > DEADLINE_S + SLACK_S]
    assert not late, f"calls that outlived their deadline of {DEADLINE_S} s: {late[:5]}"
    broken = [o for o in outcomes if o.works and o.code != "OK"]
    assert not broken, f"calls that failed on a working network (recovery included): {broken[:5]}"
    odd = [o for o in outcomes if not o.works and o.code not in ("OK", *FAILING)]
    assert not odd, f"calls on a bad network that ended with a status the client does not retry: {odd[:5]}"
    assert all(o.code != "OK" for o in outcomes if o.phase in ("blackhole", "reset", "drop_response"))
    twice = np.flatnonzero(applied > 1)
    assert twice.size == 0, f"pushes applied more than once: {[(i, applied[i]) for i in twice[:10]]}"
    for o in outcomes:
        if o.push is None:
            continue
        expected = {1.0} if o.code == "OK" or o.phase == "drop_response" else {0.0}
        if o.phase.startswith("delay") and o.code != "OK":
            expected = {0.0, 1.0}  # may have reached the shard after the call gave up
        assert applied[o.push] in expected, f"push {o.push} ({o.phase}, {o.code}) applied {applied[o.push]} times"
