"""The transport's own call threads: results, errors, waits, callbacks, cancel, limit, close."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import CancelledError
from typing import Any

import pytest
import torch

from client.transport import _CallThreads, _PooledCall
from worker.trainer import dense_adam


class Stub:
    """Stands in for a gRPC stub: returns ``b"re:" + request`` once ``gate`` is set, or raises
    ``ValueError(error)`` (a new one each time, as gRPC raises)."""

    def __init__(self, error: str | None = None) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.error = error
        self.calls = 0

    def __call__(self, request: bytes, timeout: float = 0.0, metadata: Any = ()) -> bytes:
        self.calls += 1
        self.gate.wait(10)
        if self.error is not None:
            raise ValueError(self.error)
        return b"re:" + request


@pytest.fixture
def threads() -> Any:
    t = _CallThreads(4)
    yield t
    t.close()


def submit(t: _CallThreads, stub: Stub, request: bytes = b"x") -> _PooledCall:
    call = t.submit(stub, request, {"timeout": 1.0, "metadata": ()})
    assert call is not None
    return call


def test_a_call_returns_its_answer_and_reraises_its_error(threads: _CallThreads) -> None:
    assert submit(threads, Stub(), b"a").result(5) == b"re:a"
    failing = submit(threads, Stub("boom"))
    for _ in range(2):  # every waiter gets the error
        with pytest.raises(ValueError, match="boom"):
            failing.result(5)


def test_a_wait_times_out_while_the_call_runs_and_many_waiters_all_wake(threads: _CallThreads) -> None:
    stub = Stub()
    stub.gate.clear()
    call = submit(threads, stub)
    with pytest.raises(TimeoutError):
        call.result(0.05)
    got: list[bytes] = []
    waiters = [threading.Thread(target=lambda: got.append(call.result(5))) for _ in range(3)]
    for w in waiters:
        w.start()
    stub.gate.set()
    for w in waiters:
        w.join(5)
    assert got == [b"re:x"] * 3


def test_callbacks_fire_once_before_or_after_the_end_and_one_that_raises_harms_nothing() -> None:
    t = _CallThreads(1)  # one thread: a callback that killed it would stop every later call
    try:
        stub = Stub()
        stub.gate.clear()
        call = submit(t, stub)
        fired: list[str] = []
        call.add_done_callback(lambda c: (_ for _ in ()).throw(RuntimeError("callback bug")))
        call.add_done_callback(lambda c: fired.append("before"))
        stub.gate.set()
        call.result(5)
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:  # callbacks run just after waiters wake
            time.sleep(0.001)
        call.add_done_callback(lambda c: fired.append("after"))  # finished: runs at once
        assert fired == ["before", "after"]
        assert submit(t, Stub(), b"next").result(5) == b"re:next"
    finally:
        t.close()


def test_cancel_before_the_call_starts_skips_it_and_not_once_running() -> None:
    t = _CallThreads(1)
    try:
        blocker = Stub()
        blocker.gate.clear()
        running = submit(t, blocker)
        while blocker.calls == 0:
            time.sleep(0.001)
        assert t.submit(Stub(), b"y", {}) is None  # the limit: one in flight
        assert running.cancel() is False  # already running
        blocker.gate.set()
        running.result(5)
        queued_stub = Stub()
        blocker.gate.clear()
        first = submit(t, blocker)
        while blocker.calls < 2:
            time.sleep(0.001)
        t.limit = 2
        queued = submit(t, queued_stub)
        assert queued.cancel() is True
        blocker.gate.set()
        first.result(5)
        with pytest.raises(CancelledError):
            queued.result(5)
        assert queued_stub.calls == 0
    finally:
        t.close()


def test_close_lets_queued_calls_finish_refuses_new_ones_and_stops_its_threads() -> None:
    t = _CallThreads(2)
    stub = Stub()
    stub.gate.clear()
    calls = [submit(t, stub, bytes([65 + i])) for i in range(2)]
    threading.Timer(0.05, stub.gate.set).start()
    t.close(wait_s=5)
    assert [c.result(0) for c in calls] == [b"re:A", b"re:B"]
    assert t.submit(Stub(), b"z", {}) is None
    assert not any(th.is_alive() for th in t._threads)
    t.close()  # twice: nothing happens


class Marker:
    """Rides in a call's kwargs: alive exactly as long as the call is."""


def test_a_failed_call_is_freed_without_waiting_for_the_cycle_collector(threads: _CallThreads) -> None:
    gc.collect()
    gc.disable()
    try:
        marker = Marker()
        ref = weakref.ref(marker)
        call = threads.submit(Stub("boom"), b"x", {"timeout": 1.0, "metadata": marker})
        assert call is not None
        del marker
        with pytest.raises(ValueError):
            call.result(5)
        del call
        deadline = time.monotonic() + 5
        while ref() is not None and time.monotonic() < deadline:  # the call thread lets go just after
            time.sleep(0.01)
        assert ref() is None, "a failed call stays alive until the cycle collector runs"
    finally:
        gc.enable()


def test_dense_adam_is_fused_only_where_torch_has_the_kernel() -> None:
    cpu = torch.nn.Linear(3, 2)
    assert dense_adam(cpu.parameters(), 1e-3).defaults["fused"] is True
    meta = torch.nn.Linear(3, 2, device="meta")
    assert not dense_adam(meta.parameters(), 1e-3).defaults["fused"]
