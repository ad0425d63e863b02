"""``ps.rwlock.ReadWriteLock``: readers together, a writer alone, a waiting writer first."""

from __future__ import annotations

import threading
import time

from ps.rwlock import ReadWriteLock


def test_readers_share_and_a_writer_waits_for_them() -> None:
    lock = ReadWriteLock()
    inside, events = threading.Barrier(3), []
    release = threading.Event()

    def reader() -> None:
        with lock.reading():
            inside.wait(5)  # all three are inside at once
            release.wait(5)
            events.append("reader out")

    def writer() -> None:
        with lock.writing():
            events.append("writer in")

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    time.sleep(0.1)
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.1)
    assert events == []  # the writer waits while readers hold the lock
    release.set()
    for t in [*readers, w]:
        t.join(5)
    assert events == ["reader out"] * 3 + ["writer in"]


def test_a_waiting_writer_goes_before_new_readers() -> None:
    lock = ReadWriteLock()
    order: list[str] = []
    first_in, let_go = threading.Event(), threading.Event()

    def first() -> None:
        with lock.reading():
            first_in.set()
            let_go.wait(5)

    def writer() -> None:
        with lock.writing():
            order.append("writer")

    def late_reader() -> None:
        with lock.reading():
            order.append("late reader")

    a = threading.Thread(target=first)
    a.start()
    first_in.wait(5)
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.1)  # the writer is waiting now
    r = threading.Thread(target=late_reader)
    r.start()
    time.sleep(0.1)
    assert order == []  # the late reader waits behind the writer
    let_go.set()
    for t in (a, w, r):
        t.join(5)
    assert order == ["writer", "late reader"]
