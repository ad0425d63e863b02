"""Work that yields the CPU to requests: a reshard's copies.

A live reshard copies rows while the shards go on answering lookups and pushes. On a
machine with few cores the copy (reading, packing, writing rows) would take its full share
of them and slow training several times over; run at a lower scheduling priority (a higher
nice value, per thread on Linux) it takes the cores the requests leave idle, and all of
them when training pauses. ``lower_this_thread`` lowers the calling thread's priority
(threads it starts inherit it: ``lowered`` tells shared pools not to start from it);
``produced_apart`` runs a generator in a thread of its own at that priority, for work that
a gRPC handler thread (shared by every call) would otherwise do.

Example:
    >>> list(produced_apart(iter(range(3)), "example"))
    [0, 1, 2]
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Generator, Iterator
from typing import TypeVar, cast

__all__ = ["COPY_NICE", "lower_this_thread", "lowered", "produced_apart"]

T = TypeVar("T")

COPY_NICE = 10  # CFS gives a nice-10 thread about a tenth of a nice-0 one's share when both run

_DONE = object()
_local = threading.local()


def lower_this_thread(nice: int = COPY_NICE) -> bool:
    """Raise the calling thread's nice value to ``nice`` (never lower it: that needs
    privileges). Returns False where it cannot (not Linux, or refused)."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError):
        return False
    _local.lowered = True
    return True


def lowered() -> bool:
    """Whether the calling thread lowered its priority (``lower_this_thread``): threads it
    starts would inherit that, so shared pools must not be started from it."""
    return bool(getattr(_local, "lowered", False))


def produced_apart(items: Iterator[T], name: str, depth: int = 2) -> Generator[T, None, None]:
    """``items``, computed ``depth`` ahead in a thread named ``name`` at ``COPY_NICE``.

    What ``items`` raises is raised here, at the same place in the sequence. Closing the
    returned generator (a cancelled call) stops the thread and closes ``items`` there."""
    handed: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                handed.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        lower_this_thread()
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # handed over, raised by the consumer
            put(exc)
        finally:
            close = getattr(items, "close", None)
            if callable(close):
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = handed.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield cast(T, item)
    finally:
        stop.set()
        thread.join(timeout=10)
