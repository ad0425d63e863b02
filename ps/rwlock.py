"""``ReadWriteLock``: many readers at once, or one writer; a waiting writer goes first.

A serving shard's lookups read under it together (its kernels release the GIL, so two
lookups gather rows at once), while a change batch from the training shard, or a switch
to a checkpoint, is applied under it alone. New readers wait while a writer waits, so a
steady stream of lookups cannot hold a change batch back.

Example:
    >>> lock = ReadWriteLock()
    >>> with lock.reading(), lock.reading():  # readers share it
    ...     pass
    >>> with lock.writing():
    ...     pass
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["ReadWriteLock"]


class ReadWriteLock:
    """Not reentrant: a thread that holds it must not take it again."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        # One object for every reader (it holds no state of its own): a lookup takes the
        # lock on each call, and a generator-based context manager cost as much again.
        self._reading = _Reading(self)

    def reading(self) -> _Reading:
        """A context manager: hold the lock as one of its readers."""
        return self._reading

    def _enter_reading(self) -> None:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def _exit_reading(self) -> None:
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class _Reading:
    __slots__ = ("_lock",)

    def __init__(self, lock: ReadWriteLock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        self._lock._enter_reading()

    def __exit__(self, *exc: object) -> None:
        self._lock._exit_reading()
