"""Exactly-once pushes: which ``(client_id, seq)`` pushes a table has applied.

Each table keeps its own ``PushLedger`` and updates it under the table's lock, in the
same step as the rows: so whatever part of a table reaches disk (a flush, a spill,
one push in ``every-push`` mode) is written together with a ledger that covers every
push reflected in those rows, and a push retried after a crash is never applied twice.

``encode``/``load`` give a client's entry as bytes for the data directory: ``low``
then the applied seqs above it, as little-endian uint64.

Example:
    >>> ledger = PushLedger()
    >>> with ledger.claim("w0", 1) as fresh:
    ...     fresh
    True
    >>> with ledger.claim("w0", 1) as fresh:
    ...     fresh
    False
    >>> PushLedger.decode(ledger.encode("w0"))
    (1, [])
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

__all__ = ["PushLedger"]


class _ClientSeqs:
    """Applied push sequence numbers of one client: all ``<= low``, plus ``done``."""

    __slots__ = ("low", "done", "pending")

    def __init__(self) -> None:
        self.low = 0
        self.done: set[int] = set()
        self.pending: set[int] = set()


class PushLedger:
    """Remembers which ``(client_id, seq)`` pushes were applied, so each applies once.

    A client numbers its pushes 1, 2, 3, ... (pushes may arrive out of order). The
    ledger keeps, per client, the highest seq below which everything was applied plus
    the applied seqs above it. If a client leaves more than ``window`` later pushes
    applied above a gap, the gap is given up: that seq can no longer be applied (it
    reads as a duplicate), which only happens when the client abandoned it. At most
    ``max_clients`` clients are remembered (least recently seen forgotten first).

    Thread-safe. A second arrival of a seq that is still being applied waits for the
    first: if the first succeeds it is a duplicate, if it fails the second applies it.
    """

    def __init__(self, window: int = 1 << 16, max_clients: int = 1 << 16) -> None:
        self._window = window
        self._max_clients = max_clients
        self._clients: OrderedDict[str, _ClientSeqs] = OrderedDict()
        self._cond = threading.Condition()
        self.duplicates = 0
        self._changed: set[str] = set()

    @contextlib.contextmanager
    def claim(self, client_id: str, seq: int) -> Iterator[bool]:
        """Yield True if the caller must apply this push, False if it was applied before.

        The push counts as applied only if the ``with`` body finishes without raising.
        ``seq == 0`` opts out: always True, nothing recorded.
        """
        if seq == 0:
            yield True
            return
        with self._cond:
            c = self._client(client_id)
            while seq in c.pending:
                self._cond.wait()
            if seq <= c.low or seq in c.done:
                self.duplicates += 1
                duplicate = True
            else:
                c.pending.add(seq)
                duplicate = False
        if duplicate:
            yield False
            return
        ok = False
        try:
            yield True
            ok = True
        finally:
            with self._cond:
                c.pending.discard(seq)
                if ok:
                    self._record(c, seq)
                    self._changed.add(client_id)
                self._cond.notify_all()

    def encode(self, client_id: str) -> bytes:
        """``client_id``'s entry as stored bytes (``low`` then the seqs applied above it)."""
        with self._cond:
            c = self._clients.get(client_id) or _ClientSeqs()
            return np.array([c.low, *sorted(c.done)], dtype="<u8").tobytes()

    def encode_after(self, client_id: str, seq: int) -> bytes:
        """The entry ``client_id`` will have once ``seq`` is recorded (to persist it first)."""
        with self._cond:
            c = self._clients.get(client_id) or _ClientSeqs()
            after = _ClientSeqs()
            after.low, after.done = c.low, set(c.done)
            self._advance(after, seq)
            return np.array([after.low, *sorted(after.done)], dtype="<u8").tobytes()

    @staticmethod
    def decode(data: bytes) -> tuple[int, list[int]]:
        words = np.frombuffer(data, dtype="<u8")
        if words.size == 0:
            raise ValueError("empty ledger entry")
        return int(words[0]), [int(w) for w in words[1:]]

    def load(self, client_id: str, data: bytes) -> None:
        """Restore ``client_id``'s entry from ``encode``'s bytes (at startup)."""
        low, done = self.decode(data)
        with self._cond:
            c = self._client(client_id)
            c.low, c.done = low, set(done)

    def take_changed(self) -> list[str]:
        """Clients whose entry changed since the last call (to write them out)."""
        with self._cond:
            changed, self._changed = sorted(self._changed), set()
            return changed

    def has_changes(self) -> bool:
        with self._cond:
            return bool(self._changed)

    def mark_changed(self, clients: list[str]) -> None:
        """Put back clients taken by ``take_changed`` whose write failed."""
        with self._cond:
            self._changed.update(clients)

    def _client(self, client_id: str) -> _ClientSeqs:
        c = self._clients.get(client_id)
        if c is None:
            c = self._clients[client_id] = _ClientSeqs()
            while len(self._clients) > self._max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client_id)
        return c

    def _record(self, c: _ClientSeqs, seq: int) -> None:
        self._advance(c, seq)

    def _advance(self, c: _ClientSeqs, seq: int) -> None:
        if seq <= c.low:
            # The window gave this seq up while it was in flight: it already reads as
            # applied, and keeping it in `done` would later drag `low` backwards.
            return
        c.done.add(seq)
        if len(c.done) > self._window:
            c.low = min(c.done)  # give up the oldest gap (see the class docstring)
            c.done.discard(c.low)
        while c.low + 1 in c.done:
            c.low += 1
            c.done.discard(c.low)

    def clients(self) -> list[str]:
        """Every remembered client."""
        with self._cond:
            return list(self._clients)
