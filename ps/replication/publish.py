"""A training shard's publications: named cuts of its rows that serving shards move to.

Serving shards started with ``--published-only`` follow their training shard as any
follower does, but stage what arrives and apply it only at a publication: a marker in
the change stream (``FollowBatch.published``) saying "the rows after this batch are the
ones published under this name". The trainer publishes (``Publish``) when a window of
its rows passed its guards, sending no push until the call returns.

A marker is exact only if the batch before it was built (its rows read on the leader)
after every change of the publication and before any later one. ``publish`` therefore
waits, up to ``wait_s``, for every open follower stream to have built its batches up
to the publication's version; a stream that did not (a slow follower), or that opened
after the call, gets the marker as not exact, and its follower waits for the next one,
unless its snapshot was read while no write ran and the shard took no write since the
publication (``snapshot_at``): then that snapshot is the publication. The leader keeps
no copy of published rows: exactness comes from the caller's quiet moment, bounded by
``wait_s``.

``hold`` (``ps-admin publish --hold``) refuses publications until ``release``.

Example:
    >>> from ps.replication.changes import ChangeLog
    >>> log = ChangeLog()
    >>> pubs = Publications(log)
    >>> s = pubs.open_stream(built=0)
    >>> _ = log.record([("t", np.array([1]))])
    >>> pubs.built(s, 1)
    >>> pubs.publish("000001", wait_s=1.0)
    (1, 1, 1)
    >>> pubs.marker(s, 1), pubs.marker(s, 1)
    (('000001', True), None)
"""

from __future__ import annotations

import threading

import numpy as np

from ps.replication.changes import ChangeLog

__all__ = ["Held", "Publications"]

DEFAULT_WAIT_S = 2.0


class Held(Exception):
    """Publishing is held (``hold``); the message says by whom and how to release it."""


class Publications:
    """Publications of one training shard and the build progress of its follower streams. Thread-safe."""

    def __init__(self, changes: ChangeLog) -> None:
        self.changes = changes
        self._cond = threading.Condition()
        self._streams: dict[int, int] = {}  # open stream -> version its batches are built up to
        self._next_stream = 0
        self._serial = 0  # of the newest publication
        self._current: tuple[str, int] | None = None  # (name, version) of the newest publication
        self._exact: set[int] = set()  # streams that took the newest publication exactly
        self._announced: dict[int, int] = {}  # stream -> serial of the last marker it sent
        self._deciding = False  # which streams take the newest publication exactly is not known yet
        self._one_at_a_time = threading.Lock()
        self.held_by = ""

    @property
    def published(self) -> str:
        """The newest name published ("" for none)."""
        return "" if self._current is None else self._current[0]

    # -- follower streams -------------------------------------------------------------
    def open_stream(self, built: int) -> int:
        """Register a follower stream whose batches are built up to version ``built``; returns its id."""
        with self._cond:
            self._next_stream += 1
            self._streams[self._next_stream] = built
            self._announced[self._next_stream] = self._serial  # no marker for what came before it
            return self._next_stream

    def close_stream(self, stream: int) -> None:
        with self._cond:
            self._streams.pop(stream, None)
            self._announced.pop(stream, None)
            self._exact.discard(stream)
            self._cond.notify_all()

    def built(self, stream: int, version: int) -> None:
        """The stream's batches up to ``version`` are built (every row of them read)."""
        with self._cond:
            if stream in self._streams:
                self._streams[stream] = max(self._streams[stream], version)
                self._cond.notify_all()

    def snapshot_at(self, stream: int, version: int) -> None:
        """The stream's snapshot holds the rows of ``version`` exactly (no write ran while it
        was read): if that is the newest publication's version, the stream announces it, exact."""
        with self._cond:
            if stream in self._streams and self._current is not None and not self._deciding:
                if self._current[1] == version:
                    self._announced[stream] = self._serial - 1
                    self._exact.add(stream)

    def marker(self, stream: int, built: int) -> tuple[str, bool] | None:
        """``(name, exact)`` of the publication the stream announces next, once its batches
        are built up to ``built``; None when it has none to announce."""
        with self._cond:
            if self._current is None or self._deciding or self._announced.get(stream, self._serial) == self._serial:
                return None
            name, version = self._current
            if built < version:
                return None
            self._announced[stream] = self._serial
            return name, stream in self._exact

    # -- publishing -------------------------------------------------------------------
    def publish(self, name: str, wait_s: float = DEFAULT_WAIT_S) -> tuple[int, int, int]:
        """Name the rows as they are now ``name``; returns ``(version, streams, exact)``:
        the shard's version, the follower streams open and those that built up to it
        within ``wait_s`` (see the module). Raises ``Held`` while publishing is held."""
        with self._one_at_a_time, self._cond:
            if self.held_by:
                raise Held(self.held_by)
            version = self.changes.version
            self._serial += 1
            self._current, self._exact, self._deciding = (name, version), set(), True
            try:
                self._cond.wait_for(lambda: all(v >= version for v in self._streams.values()), wait_s)
                self._exact = {s for s, v in self._streams.items() if v >= version}
            finally:
                self._deciding = False
            streams, exact = len(self._streams), len(self._exact)
        self.changes.wake()  # streams waiting for changes announce it now
        return version, streams, exact

    def hold(self, why: str) -> None:
        with self._cond:
            self.held_by = why or "held"

    def release(self) -> None:
        with self._cond:
            self.held_by = ""


_ = np  # the doctest builds key arrays
