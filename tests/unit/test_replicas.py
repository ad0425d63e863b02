"""Replicas in the client: address parsing, config checks, the circuit breaker's state machine
(``ReplicaSet`` with explicit times), and ``PSClient`` spreading, failing over, hedging and
degrading over real ``Shard``s behind ``InProcessTransport`` (no network).

A "hanging" endpoint stands for a stopped replica: its calls finish only when cancelled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from client import (
    ClientConfig,
    DeadlineExceededError,
    InvalidRequestError,
    LookupResult,
    PSClient,
    ShardUnavailableError,
    TableNotFoundError,
    parse_addresses,
)
from client.replicas import FAILED, NEUTRAL, OK, ReplicaSet
from protos.keys import shard_of
from ps.shard import Shard
from tests.fakes import FakeRpcError, InProcessTransport

DIM = 4
KEYS = np.arange(-20, 60, dtype=np.int64)
FAST = ClientConfig(backoff_initial_s=0.001, backoff_max_s=0.002, tune_malloc=False)


# -- parse_addresses and PSClient(addresses) -------------------------------------------


def test_parse_addresses_reads_shards_and_replicas() -> None:
    assert parse_addresses("h:1|h:2,h:3") == [["h:1", "h:2"], ["h:3"]]
    assert parse_addresses(" 10.0.0.1:5 | 10.0.0.2:5 ,\t[::1]:7 ") == [["10.0.0.1:5", "10.0.0.2:5"], ["[::1]:7"]]
    assert parse_addresses("h:1") == [["h:1"]]


def test_plus_separates_replicas_as_pipe_does() -> None:
    # '+' is safe unquoted in a shell (bash reads '|' as a pipe); '|' still works when quoted.
    assert parse_addresses("h:1+h:2,h:3+[::1]:4") == [["h:1", "h:2"], ["h:3", "[::1]:4"]]
    assert parse_addresses("h:1 + h:2|h:5,h:3") == [["h:1", "h:2", "h:5"], ["h:3"]]


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("h:1,,h:2", "shard 1 is empty"),
        ("h:1,", "shard 1 is empty"),
        ("h:1||h:2", "shard 0 .* has an empty replica"),
        ("h:1,h:2|", "shard 1 .* has an empty replica"),
        ("h:1,h", "shard 1: 'h' is not HOST:PORT"),
        ("h:1|:5", "shard 0: ':5' is not HOST:PORT"),
        ("h:x", "'h:x' is not HOST:PORT"),
        ("h:0", "'h:0' is not HOST:PORT"),
        ("h:70000", "'h:70000' is not HOST:PORT"),
        ("h:1|h:1", "h:1 is given twice"),
        ("h:1,h:2|h:1", r"h:1 is given twice \(shard 0 and shard 1\)"),
    ],
)
def test_parse_addresses_names_the_bad_part(text: str, names: str) -> None:
    with pytest.raises(InvalidRequestError, match=names) as info:
        parse_addresses(text)
    assert isinstance(info.value, ValueError)


def test_client_takes_strings_or_replica_lists_and_does_no_io() -> None:
    ps = PSClient([["h:1", "h:2"], "h:3", ("h:4",)])
    assert ps.num_shards == 3
    assert ps.replicas == [("h:1", "h:2"), ("h:3",), ("h:4",)]
    assert ps.addresses == ["h:1", "h:2", "h:3", "h:4"]  # the order of stats() and replica_health()
    assert [h["shard"] for h in ps.admin.replica_health()] == [0, 0, 1, 2]
    assert {h["state"] for h in ps.admin.replica_health()} == {"in_service"}


@pytest.mark.parametrize(
    ("addresses", "names"),
    [
        ("h:1", "non-empty list"),
        ([], "non-empty list"),
        (["h:1", []], "shard 1 is \\[\\]"),
        ([["h:1", ""]], "shard 0"),
        (["h:1", ["h:2", "h:1"]], "h:1 is given twice"),
    ],
)
def test_client_rejects_malformed_addresses(addresses: Any, names: str) -> None:
    with pytest.raises(InvalidRequestError, match=names):
        PSClient(addresses)


# -- ClientConfig -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hedge_after_s", 0.0),
        ("hedge_after_s", -1.0),
        ("hedge_after_s", float("nan")),
        ("hedge_after_s", float("inf")),
        ("eject_after_failures", 0),
        ("eject_s", 0.0),
        ("eject_s", float("inf")),
        ("eject_max_s", -1.0),
    ],
)
def test_config_names_the_bad_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field}="):
        ClientConfig(**{field: value})


def test_config_defaults_and_eject_bounds() -> None:
    c = ClientConfig()
    assert (c.hedge_after_s, c.eject_after_failures, c.eject_s, c.eject_max_s) == (None, 3, 1.0, 30.0)
    with pytest.raises(ValueError, match=r"eject_s=5.0: must be <= eject_max_s=2.0"):
        ClientConfig(eject_s=5.0, eject_max_s=2.0)
    assert ClientConfig(hedge_after_s=0.01).hedge_after_s == 0.01


# -- the breaker ------------------------------------------------------------------------


def replica_set(n: int = 2, eject_after: int = 3) -> ReplicaSet:
    return ReplicaSet(
        [[f"h:{i + 1}" for i in range(n)]], eject_after_failures=eject_after, eject_s=1.0, eject_max_s=4.0
    )


def states(rs: ReplicaSet, now: float) -> list[str]:
    return [h["state"] for h in rs.health(now)]


def fail(rs: ReplicaSet, endpoint: int, now: float, times: int = 1) -> None:
    for _ in range(times):
        rs.release(rs.take(endpoint), FAILED, now)


def test_consecutive_failures_eject_and_reads_avoid_the_ejected_replica() -> None:
    rs = replica_set()
    fail(rs, 0, now=0.0, times=2)
    rs.release(rs.take(0), OK, 0.0)  # a success resets the count
    fail(rs, 0, now=0.0, times=2)
    assert states(rs, 0.0) == ["in_service", "in_service"]
    rs.release(rs.take(0), NEUTRAL, 0.0)  # says nothing about the replica
    fail(rs, 0, now=0.0)
    assert states(rs, 0.0) == ["ejected", "in_service"]
    assert rs.health(0.0)[0]["ejected_for_s"] == pytest.approx(1.0)
    picks = [rs.pick(0, now=0.5) for _ in range(10)]
    assert {p.endpoint for p in picks} == {1}
    assert not rs.available(0, exclude={1}) and rs.available(0)
    assert rs.probe(0, now=0.9) is None  # not yet


def test_half_open_sends_one_probe_and_its_success_puts_the_replica_back() -> None:
    rs = replica_set()
    fail(rs, 0, now=0.0, times=3)
    probe = rs.probe(0, now=1.0)  # the ejection has run out: one probe may go
    assert probe is not None and probe.endpoint == 0 and probe.probe
    assert states(rs, 1.0) == ["probing", "in_service"]
    assert rs.probe(0, now=1.1) is None  # one probe at a time
    assert {rs.pick(0, now=1.1).endpoint for _ in range(5)} == {1}  # reads wait for the probe's outcome
    rs.release(probe, OK, 1.2)
    assert states(rs, 1.2) == ["in_service", "in_service"]
    assert rs.health(1.2)[0]["failures"] == 0


def test_failed_probes_eject_again_for_twice_as_long_up_to_the_cap() -> None:
    rs = replica_set()
    fail(rs, 0, now=0.0, times=3)
    now, lengths = 0.0, []
    for _ in range(4):
        now += lengths[-1] if lengths else 1.0
        probe = rs.probe(0, now=now)
        assert probe is not None and probe.endpoint == 0
        rs.release(probe, FAILED, now)
        lengths.append(rs.health(now)[0]["ejected_for_s"])
    assert lengths == pytest.approx([2.0, 4.0, 4.0, 4.0])  # eject_max_s=4
    probe = rs.probe(0, now=now + 4.0)
    assert probe is not None
    rs.release(probe, OK, now + 4.0)
    fail(rs, 0, now=now + 5, times=3)
    assert rs.health(now + 5)[0]["ejected_for_s"] == pytest.approx(1.0)  # back to eject_s after a success


def test_with_every_replica_ejected_the_one_back_first_is_tried() -> None:
    rs = replica_set(3)
    fail(rs, 0, now=0.2, times=3)
    fail(rs, 1, now=0.0, times=3)
    fail(rs, 2, now=0.1, times=3)
    assert states(rs, 0.5) == ["ejected"] * 3
    assert rs.pick(0, now=0.5).endpoint == 1
    assert rs.pick_other(0, exclude=()) is None  # no hedge to an ejected replica


def test_a_single_replica_is_never_ejected() -> None:
    rs = replica_set(1)
    fail(rs, 0, now=0.0, times=50)
    assert states(rs, 0.0) == ["in_service"]
    assert rs.pick(0, exclude={0}, now=0.0).endpoint == 0
    assert rs.pick_other(0, exclude={0}) is None


def test_reads_go_to_the_replica_with_fewest_in_flight_ties_round_robin() -> None:
    rs = replica_set(3)
    held = [rs.pick(0, now=0.0) for _ in range(3)]
    assert sorted(p.endpoint for p in held) == [0, 1, 2]  # one each
    rs.release(held[1], OK, 0.0)
    assert rs.pick(0, now=0.0).endpoint == held[1].endpoint  # the only one with nothing in flight
    for p in [*held[:1], *held[2:]]:
        rs.release(p, OK, 0.0)
    rs2 = replica_set(3)
    turns = []
    for _ in range(30):
        p = rs2.pick(0, now=0.0)
        turns.append(p.endpoint)
        rs2.release(p, OK, 0.0)
    assert {e: turns.count(e) for e in range(3)} == {0: 10, 1: 10, 2: 10}


# -- PSClient over in-process replicas --------------------------------------------------


class _Hanging:
    """A call to a stopped replica: it finishes (CANCELLED) only when cancelled."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._callbacks: list[Callable[[Any], None]] = []

    def result(self, timeout_s: float | None = None) -> bytes:
        if not self._done.wait(timeout_s):
            raise TimeoutError
        raise FakeRpcError(grpc.StatusCode.CANCELLED, "cancelled")

    def cancel(self) -> bool:
        self._done.set()
        for fn in self._callbacks:
            fn(self)
        return True

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._callbacks.append(fn)


class _Replicas(InProcessTransport):
    """``InProcessTransport`` whose endpoints in ``hanging`` never answer."""

    def __init__(self, shards: list[Shard]) -> None:
        super().__init__(shards)
        self.hanging: set[int] = set()
        self.hung: list[_Hanging] = []

    def call(self, shard: int, method: str, request: bytes, timeout_s: float) -> Any:
        if shard in self.hanging:
            with self._lock:
                self.calls.append((shard, method, request))
            self.hung.append(_Hanging())
            return self.hung[-1]
        return super().call(shard, method, request, timeout_s)


def create(shards: list[Shard], name: str = "t") -> None:
    for s in shards:
        with PSClient(["inproc:0"], FAST, transport=InProcessTransport([s])) as one:
            one.create_table(name, DIM, seed=5)


@pytest.fixture
def two() -> list[Shard]:
    """Two replicas of a one-shard cluster, each holding table ``t``."""
    shards = [Shard(0, 1), Shard(0, 1)]
    create(shards)
    return shards


@pytest.fixture
def transport(two: list[Shard]) -> _Replicas:
    return _Replicas(two)


@pytest.fixture
def ps(transport: _Replicas) -> Iterator[PSClient]:
    with PSClient([["inproc:0", "inproc:1"]], FAST, transport=transport) as client:
        yield client


def expected(shard: Shard, keys: np.ndarray) -> np.ndarray:
    with PSClient(["inproc:0"], FAST, transport=InProcessTransport([shard])) as one:
        return one.lookup("t", keys)


def test_reads_spread_over_replicas_and_answer_alike(ps: PSClient, transport: _Replicas, two: list[Shard]) -> None:
    want = expected(two[0], KEYS)
    for _ in range(10):
        np.testing.assert_array_equal(ps.lookup("t", KEYS), want)
    assert transport.count("Lookup", 0) == transport.count("Lookup", 1) == 5
    stats = ps.admin.stats()
    assert [s["address"] for s in stats] == ["inproc:0", "inproc:1"] and [s["shard"] for s in stats] == [0, 0]


def test_a_failing_replica_fails_over_at_once_and_is_ejected(ps: PSClient, transport: _Replicas) -> None:
    transport.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE, times=1000, shard=0)
    started = time.monotonic()
    for _ in range(20):
        assert ps.lookup("t", KEYS).shape == (len(KEYS), DIM)
    assert time.monotonic() - started < 2.0
    assert transport.count("Lookup", 0) == 3  # eject_after_failures, then no more reads there
    assert transport.count("Lookup", 1) == 20
    assert [h["state"] for h in ps.admin.replica_health()] == ["ejected", "in_service"]


def test_writes_to_a_replicated_shard_are_refused_before_any_rpc(ps: PSClient, transport: _Replicas) -> None:
    for write in (
        lambda: ps.push("t", [1], np.ones((1, DIM), np.float32)),
        lambda: ps.create_table("u", DIM),
        lambda: ps.admin.checkpoint(),
    ):
        with pytest.raises(
            InvalidRequestError,
            match=r"shard 0 has 2 replicas \(inproc:0\|inproc:1\); replicas are "
            "read-only serving copies: push to the training shard they follow",
        ) as info:
            write()
        assert info.value.shard == 0
    assert not [c for c in transport.calls if c[1] not in ("ListTables", "GetMap")]  # asking is no write


def test_hedge_goes_to_the_other_replica_and_wins(two: list[Shard], transport: _Replicas) -> None:
    transport.hanging = {0}
    config = ClientConfig(hedge_after_s=0.02, deadline_s=5.0, tune_malloc=False)
    with PSClient([["inproc:0", "inproc:1"]], config, transport=transport) as ps:
        started = time.monotonic()
        for _ in range(6):
            np.testing.assert_array_equal(ps.lookup("t", KEYS), expected(two[1], KEYS))
        took = time.monotonic() - started
        health = ps.admin.replica_health()
    assert took < 2.0
    assert len(transport.hung) == 3  # three hedge races lost, then ejected
    assert [h["state"] for h in health] == ["ejected", "in_service"] and health[0]["inflight"] == 0
    assert all(h._done.is_set() for h in transport.hung)  # the losers were cancelled


def test_per_call_deadline_and_degrade(transport: _Replicas) -> None:
    shards = [Shard(0, 2), Shard(1, 2)]
    create(shards)
    t = _Replicas(shards)
    t.hanging = {1}
    with PSClient(["inproc:0", "inproc:1"], FAST, transport=t) as ps:
        started = time.monotonic()
        with pytest.raises(
            DeadlineExceededError,
            match=r"shard 1 \(inproc:1\): Lookup got no answer before "
            r"deadline_s=0.2 passed",
        ) as info:
            ps.lookup("t", KEYS, deadline_s=0.2)
        assert info.value.shard == 1 and 0.15 < time.monotonic() - started < 1.5
        started = time.monotonic()
        rows, degraded = ps.lookup("t", KEYS, deadline_s=0.2, degrade=True)
        result = ps.lookup_many({"t": KEYS}, deadline_s=0.2, degrade=True)
        assert time.monotonic() - started < 1.5
        t.hanging = set()
        healthy = ps.lookup_many({"t": KEYS})
    on_1 = shard_of(KEYS, 2) == 1
    assert degraded == (1,) and isinstance(result, LookupResult) and result.degraded == (1,)
    assert isinstance(healthy, LookupResult) and healthy.degraded == () and healthy.publications == ("",)
    for got in (rows, result["t"]):
        assert not got[on_1].any()
        np.testing.assert_array_equal(got[~on_1], healthy["t"][~on_1])
        assert on_1.any() and got[~on_1].any()


def test_degrade_still_raises_statuses_that_are_not_retried(two: list[Shard]) -> None:
    t = InProcessTransport(two[:1])
    with PSClient(["inproc:0"], FAST, transport=t) as ps:
        with pytest.raises(TableNotFoundError):
            ps.lookup("missing", KEYS, degrade=True, deadline_s=0.5)
        t.fail_next("Lookup", grpc.StatusCode.INVALID_ARGUMENT)
        with pytest.raises(InvalidRequestError, match=r"shard 0 \(inproc:0\)"):
            ps.lookup("t", KEYS, degrade=True)
        # Backoffs of 0-2 ms fit about a hundred tries into 0.1 s: fail every one of them.
        t.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE, times=1_000_000)
        rows, degraded = ps.lookup("t", KEYS, degrade=True, deadline_s=0.1)
        assert degraded == (0,) and not rows.any()
        with pytest.raises(InvalidRequestError, match="deadline_s=0: must be a positive"):
            ps.lookup("t", KEYS, deadline_s=0)


def test_retries_without_another_replica_back_off_until_the_deadline(two: list[Shard]) -> None:
    t = InProcessTransport(two)
    config = ClientConfig(deadline_s=0.3, backoff_initial_s=0.01, backoff_max_s=0.02, tune_malloc=False)
    with PSClient([["inproc:0", "inproc:1"]], config, transport=t) as ps:
        t.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE, times=10_000)
        with pytest.raises(ShardUnavailableError, match=r"deadline_s=0.3 passed") as info:
            ps.lookup("t", KEYS)
    assert info.value.shard == 0
    # Both tried and ejected; then the one whose ejection ends first is tried on.
    assert min(t.count("Lookup", 0), t.count("Lookup", 1)) >= 3 and t.count("Lookup") > 10


def test_an_ejected_replica_is_probed_with_a_copy_of_a_read_and_comes_back(two: list[Shard]) -> None:
    transport = _Replicas(two)
    config = ClientConfig(
        eject_s=0.05, eject_max_s=1.0, backoff_initial_s=0.001, backoff_max_s=0.002, tune_malloc=False
    )
    with PSClient([["inproc:0", "inproc:1"]], config, transport=transport) as ps:
        transport.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE, times=3, shard=0)
        for _ in range(6):  # reads alternate: three of these reach replica 0
            ps.lookup("t", KEYS)
        assert ps.admin.replica_health()[0]["state"] == "ejected" and transport.count("Lookup", 0) == 3
        transport.hanging = {0}  # now it hangs: the probe must not hold the read up
        time.sleep(0.06)
        started = time.monotonic()
        ps.lookup("t", KEYS)
        assert time.monotonic() - started < 0.5
        assert len(transport.hung) == 1 and ps.admin.replica_health()[0]["state"] == "probing"
        transport.hung[0].cancel()  # the probe fails: ejected again, for twice as long
        assert ps.admin.replica_health()[0]["state"] == "ejected"
        assert 0.05 < ps.admin.replica_health()[0]["ejected_for_s"] <= 0.1
        transport.hanging = set()
        time.sleep(0.11)
        before = transport.count("Lookup", 0)
        ps.lookup("t", KEYS)  # its copy is the probe, and it answers
        assert transport.count("Lookup", 0) == before + 1
        assert [h["state"] for h in ps.admin.replica_health()] == ["in_service", "in_service"]
        for _ in range(10):
            ps.lookup("t", KEYS)
    assert transport.count("Lookup", 0) == before + 6  # reads spread again
