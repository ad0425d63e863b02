"""ps.yielding: a generator run in a lower-priority thread of its own."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ps.store import Storage, storage
from ps.yielding import COPY_NICE, lower_this_thread, lowered, produced_apart


def test_items_and_errors_come_in_order() -> None:
    def items() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("the third one")

    got = []
    with pytest.raises(ValueError, match="the third one"):
        for item in produced_apart(items(), "test-order"):
            got.append(item)
    assert got == [1, 2]


def test_closing_early_stops_the_thread_and_closes_the_source() -> None:
    closed = threading.Event()
    made = []

    def items() -> Iterator[int]:
        try:
            for i in range(10_000):
                made.append(i)
                yield i
        finally:
            closed.set()

    stream = produced_apart(items(), "test-close", depth=2)
    assert next(stream) == 0
    stream.close()
    assert closed.wait(10), "the source generator was never closed"
    assert len(made) <= 4, f"{len(made)} items were made for a consumer that took one"
    assert not any(t.name == "test-close" for t in threading.enumerate())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are a Linux feature")
def test_the_producer_thread_runs_at_a_lower_priority() -> None:
    def items() -> Iterator[int]:
        yield os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert list(produced_apart(items(), "test-nice")) == [max(main_nice, COPY_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice  # the caller's is unchanged


def test_lower_this_thread_never_raises_priority() -> None:
    seen: list[int] = []

    def run() -> None:
        assert lower_this_thread(COPY_NICE + 5)
        assert lower_this_thread(COPY_NICE)  # asks for less: left as it is
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen and seen[0] >= COPY_NICE + 5


def test_a_lowered_thread_reads_alone_and_starts_no_shared_reader(tmp_path: Path) -> None:
    """Threads inherit their creator's nice value: the storage's reader pool, shared with
    requests, must not be started by a reshard's lowered copy thread."""
    keys = [b"k%07d" % i for i in range(4 * storage._READ_PART_MIN)]
    seen: list[set[str]] = []

    def get(part: list[bytes]) -> list[bytes | None]:
        seen.append({threading.current_thread().name})
        return [None] * len(part)

    with Storage(tmp_path / "data", shard=0, num_shards=1) as st:

        def copy() -> None:
            assert lower_this_thread() and lowered()
            assert st._read(get, keys) == [None] * len(keys)

        thread = threading.Thread(target=copy, name="test-copy")
        thread.start()
        thread.join()
        assert seen == [{"test-copy"}], seen
        assert not any(t.name.startswith("ps-read") for t in threading.enumerate())
        if storage._READ_THREADS > 1:  # a request's thread still splits a long read
            seen.clear()
            st._read(get, keys)
            assert len(seen) > 1
    assert not lowered()  # this thread was never lowered
