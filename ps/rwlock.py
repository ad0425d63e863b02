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

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
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
