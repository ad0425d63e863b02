"""Exactly-once pushes: which ``(client_id, seq)`` pushes a table has applied.

Each table keeps its own ``PushLedger`` and updates it under the table's lock, in the
same step as the rows: so whatever part of a table reaches disk (a flush, a spill,
one push in ``every-push`` mode) is written together with a ledger that covers every
push reflected in those rows, and a push retried after a crash is never applied twice.

A client's entry is ``low`` (every seq up to it was applied) and the ranges of seqs
applied above it, ``[(first, last), ...]``, sorted and apart. A client that sends every
seq to every shard keeps it at ``low`` alone; a gap (a push a shard refused, or one that
reached another shard after the cluster changed) costs one range, not one number per
later push.

``encode``/``load`` give a client's entry as bytes for the data directory: a marker,
``low``, then each range's first and last seq, as little-endian uint64. ``decode``
also reads the older form, ``low`` then each applied seq above it.

Example:
    >>> ledger = PushLedger()
    >>> with ledger.claim("w0", 1) as fresh:
    ...     fresh
    True
    >>> with ledger.claim("w0", 1) as fresh:
    ...     fresh
    False
    >>> for seq in (4, 5):
    ...     with ledger.claim("w0", seq):
    ...         pass
    >>> PushLedger.decode(ledger.encode("w0"))
    (1, [(4, 5)])
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

__all__ = ["PushLedger"]


_RANGES = (1 << 64) - 2  # first word of the encoding with ranges (no low is that high)


class _ClientSeqs:
    """Applied push sequence numbers of one client: all ``<= low``, plus ``ranges``
    (``[first, last]`` pairs, sorted, each at least one seq above the one before)."""

    __slots__ = ("low", "ranges", "pending")

    def __init__(self, low: int = 0, ranges: list[list[int]] | None = None) -> None:
        self.low = low
        self.ranges: list[list[int]] = ranges if ranges is not None else []
        self.pending: set[int] = set()

    def copy(self) -> _ClientSeqs:
        return _ClientSeqs(self.low, [list(r) for r in self.ranges])

    def has(self, seq: int) -> bool:
        if seq <= self.low:
            return True
        i = bisect.bisect_right(self.ranges, [seq, 1 << 64]) - 1
        return i >= 0 and self.ranges[i][0] <= seq <= self.ranges[i][1]

    def add(self, seq: int, window: int) -> None:
        if self.has(seq):
            # Already applied, or given up by the window while it was in flight: it reads
            # as applied either way.
            return
        r = self.ranges
        i = bisect.bisect_right(r, [seq, 1 << 64])  # ranges before i start at or below seq
        joins_left = i > 0 and r[i - 1][1] + 1 == seq
        joins_right = i < len(r) and r[i][0] == seq + 1
        if joins_left and joins_right:
            r[i - 1][1] = r[i][1]
            del r[i]
        elif joins_left:
            r[i - 1][1] = seq
        elif joins_right:
            r[i][0] = seq
        else:
            r.insert(i, [seq, seq])
        if r and r[0][0] == self.low + 1:
            self.low = r.pop(0)[1]
        # Give up the oldest gap once more than ``window`` seqs above it were applied: the
        # client abandoned that push (see ``PushLedger``).
        while r and sum(last - first + 1 for first, last in r) > window:
            self.low = r.pop(0)[1]

    def words(self) -> list[int]:
        return [_RANGES, self.low, *(x for pair in self.ranges for x in pair)]


class PushLedger:
    """Remembers which ``(client_id, seq)`` pushes were applied, so each applies once.

    A client numbers its pushes 1, 2, 3, ... (pushes may arrive out of order). The
    ledger keeps, per client, the highest seq below which everything was applied plus
    the ranges applied above it. If a client leaves more than ``window`` later pushes
    applied above a gap, the gap is given up: its seqs can no longer be applied (they
    read as duplicates), which only happens when the client abandoned them. At most
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
            if c.has(seq):
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
                    c.add(seq, self._window)
                    self._changed.add(client_id)
                self._cond.notify_all()

    def encode(self, client_id: str) -> bytes:
        """``client_id``'s entry as stored bytes (see the module docstring)."""
        with self._cond:
            c = self._clients.get(client_id) or _ClientSeqs()
            return np.array(c.words(), dtype="<u8").tobytes()

    def encode_after(self, client_id: str, seq: int) -> bytes:
        """The entry ``client_id`` will have once ``seq`` is recorded (to persist it first)."""
        with self._cond:
            c = self._clients.get(client_id)
            after = c.copy() if c is not None else _ClientSeqs()
            after.add(seq, self._window)
            return np.array(after.words(), dtype="<u8").tobytes()

    @staticmethod
    def decode(data: bytes) -> tuple[int, list[tuple[int, int]]]:
        """``(low, ranges)`` of a stored entry, either form (see the module docstring)."""
        words = [int(w) for w in np.frombuffer(data, dtype="<u8")]
        if not words:
            raise ValueError("empty ledger entry")
        if words[0] != _RANGES:
            return words[0], _ranges_of(sorted(words[1:]))
        if len(words) < 2 or len(words) % 2:
            raise ValueError(f"ledger entry of {len(words)} words: expected a marker, low and pairs")
        return words[1], [(words[i], words[i + 1]) for i in range(2, len(words), 2)]

    def load(self, client_id: str, data: bytes) -> None:
        """Restore ``client_id``'s entry from ``encode``'s bytes (at startup)."""
        low, ranges = self.decode(data)
        with self._cond:
            c = self._client(client_id)
            c.low, c.ranges = low, [[a, b] for a, b in ranges]

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

    def clients(self) -> list[str]:
        """Every remembered client."""
        with self._cond:
            return list(self._clients)


def _ranges_of(seqs: list[int]) -> list[tuple[int, int]]:
    """Sorted seqs as ``(first, last)`` runs."""
    out: list[tuple[int, int]] = []
    for seq in seqs:
        if out and out[-1][1] + 1 >= seq:
            out[-1] = (out[-1][0], max(out[-1][1], seq))
        else:
            out.append((seq, seq))
    return out
