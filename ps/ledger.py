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
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["KeyOrigins", "PushLedger", "TableLedgers", "moved_key"]


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

    @staticmethod
    def pack(low: int, ranges: list[tuple[int, int]]) -> bytes:
        """The stored bytes of the entry ``(low, ranges)`` (``decode``'s inverse)."""
        return np.array([_RANGES, low, *(x for pair in ranges for x in pair)], dtype="<u8").tobytes()

    def knows(self, client_id: str) -> bool:
        """Whether ``client_id`` has an entry here (asking does not create one)."""
        with self._cond:
            return client_id in self._clients

    def entry(self, client_id: str) -> tuple[int, list[tuple[int, int]]] | None:
        """``(low, ranges)`` of ``client_id``, or None if it has no entry."""
        with self._cond:
            c = self._clients.get(client_id)
            return None if c is None else (c.low, [(a, b) for a, b in c.ranges])

    def forget(self, client_id: str) -> None:
        """Drop ``client_id``'s entry (it merged into another ledger)."""
        with self._cond:
            self._clients.pop(client_id, None)
            self._changed.discard(client_id)

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


def moved_key(origin: int, client_id: str) -> str:
    """The stored name of ``client_id``'s entry in the ledger of keys that came from shard
    ``origin`` (client ids are printable, so the leading NUL never meets one)."""
    return f"\0{origin}\0{client_id}"


def _split_key(key: str) -> tuple[int | None, str]:
    if key.startswith("\0"):
        origin, client_id = key[1:].split("\0", 1)
        return int(origin), client_id
    return None, key


class TableLedgers:
    """A table's exactly-once records: its own ``PushLedger`` (``main``) and, after a
    reshard that brought it keys, the ledgers of the shards they came from.

    Each push is recorded in the ledger of the keys it was applied to: a key that moved
    here keeps the record of its old owner (``moved[origin]``), so a push applied there
    and not here, or the reverse, is applied exactly once to every key whatever the
    order of retries and moves (``ps.shard`` tells which keys belong to which origin).
    A client's entry in a moved ledger merges back into ``main`` once the two agree
    and hold every push from before the move (``pending`` counts those that do not
    yet: a new reshard waits for 0). Stored entries are named by ``client_id`` in
    ``main`` and by ``moved_key(origin, client_id)`` in a moved ledger; an empty entry
    stored means one that merged away.

    Not thread-safe for writes: the table calls it under its lock. ``pending`` and the
    exports are safe from any thread.

    Example:
        >>> ledgers = TableLedgers()
        >>> ledgers.import_moved(1, {"w": PushLedger.pack(5, [])})
        >>> with ledgers.claim("w", 5, origin=1) as fresh:
        ...     fresh  # applied on shard 1 before the keys moved
        False
        >>> with ledgers.claim("w", 5) as fresh:
        ...     fresh  # not applied to this shard's own keys yet
        True
        >>> for seq in (1, 2, 3, 4):
        ...     with ledgers.claim("w", seq):
        ...         pass
        >>> ledgers.pending()  # main caught up: the moved entry merged
        0
    """

    def __init__(self, window: int = 1 << 16, max_clients: int = 1 << 16) -> None:
        self.main = PushLedger(window, max_clients)
        self.moved: dict[int, PushLedger] = {}
        self._high: dict[tuple[int, str], int] = {}  # newest seq from before the move
        self._merged: set[str] = set()  # moved entries merged away, not yet written as such
        self._window, self._max_clients = window, max_clients
        self._lock = threading.Lock()

    @property
    def duplicates(self) -> int:
        return self.main.duplicates + sum(m.duplicates for m in self.moved.values())

    def ledger(self, client_id: str, origin: int | None) -> PushLedger:
        """The ledger that records ``client_id``'s pushes to keys from ``origin`` (None:
        this shard's own): ``main`` where the moved entry merged back, or never was."""
        if origin is None:
            return self.main
        moved = self.moved.get(origin)
        return moved if moved is not None and moved.knows(client_id) else self.main

    @contextlib.contextmanager
    def claim(self, client_id: str, seq: int, origin: int | None = None) -> Iterator[bool]:
        """``PushLedger.claim`` in the ledger of ``client_id``'s pushes to keys from
        ``origin``; merges entries that agree afterwards."""
        ledger = self.ledger(client_id, origin)
        with ledger.claim(client_id, seq) as fresh:
            yield fresh
        if seq and self.moved:
            self._merge(client_id)

    def groups(
        self, origins: KeyOrigins, client_id: str, n: int
    ) -> list[tuple[int | None, npt.NDArray[np.bool_] | None]]:
        """``origins.groups(n)`` with the groups ``client_id``'s pushes are recorded for in
        one ledger taken together (a moved entry that merged back is in ``main``): each
        is applied and recorded as one push. The caller holds the table's lock."""
        merged: dict[int | None, npt.NDArray[np.bool_] | None] = {}
        for origin, picked in origins.groups(n):
            target = origin if origin is not None and self.ledger(client_id, origin) is not self.main else None
            if target in merged:
                before = merged[target]
                merged[target] = None if before is None or picked is None else before | picked
            else:
                merged[target] = picked
        return list(merged.items())

    def encode_after(self, client_id: str, seq: int, origin: int | None = None) -> tuple[str, bytes]:
        """``(stored name, entry)`` once ``seq`` is recorded for keys from ``origin``."""
        ledger = self.ledger(client_id, origin)
        key = client_id if ledger is self.main else moved_key(self._origin_of(ledger), client_id)
        return key, ledger.encode_after(client_id, seq)

    def _origin_of(self, ledger: PushLedger) -> int:
        return next(o for o, m in self.moved.items() if m is ledger)

    def _merge(self, client_id: str) -> None:
        main = self.main.entry(client_id)
        for origin, moved in list(self.moved.items()):
            entry = moved.entry(client_id)
            if entry is None:
                continue
            high = self._high.get((origin, client_id), 0)
            if entry == main and entry[0] >= high:
                moved.forget(client_id)
                with self._lock:
                    self._high.pop((origin, client_id), None)
                    self._merged.add(moved_key(origin, client_id))
            if not moved.clients():
                with self._lock:
                    del self.moved[origin]

    def import_moved(self, origin: int, entries: dict[str, bytes], *, new_shard: bool = False) -> None:
        """Take the ledger entries of shard ``origin`` whose keys move here (at a reshard's
        freeze); each stays apart until this shard's own entry agrees with it.

        ``new_shard``: this shard held no keys before the reshard, so no push from before
        it was recorded for keys of its own, and its own entry of a client it never heard
        from may start as any origin's (one less entry to wait for)."""
        moved = self.moved.get(origin) or PushLedger(self._window, self._max_clients)
        for client_id, data in entries.items():
            low, ranges = PushLedger.decode(data)
            mine = self.main.entry(client_id)
            if mine is None and new_shard:
                self.main.load(client_id, data)
                self.main.mark_changed([client_id])
                mine = (low, ranges)
            high = max([low, *(b for _, b in ranges), *(([mine[0]] + [b for _, b in mine[1]]) if mine else [])])
            moved.load(client_id, data)
            moved.mark_changed([client_id])
            with self._lock:
                self._high[(origin, client_id)] = high
        with self._lock:
            self.moved[origin] = moved
        for client_id in entries:
            self._merge(client_id)

    def origins(self, client_id: str) -> list[int]:
        """The shards whose moved ledger here holds an entry of ``client_id``."""
        return [o for o, m in list(self.moved.items()) if m.knows(client_id)]

    def pending(self) -> int:
        """Entries of moved ledgers not merged back yet."""
        with self._lock:
            return sum(len(m.clients()) for m in self.moved.values())

    # -- what the table writes --------------------------------------------------------

    def load(self, key: str, data: bytes) -> None:
        """Restore a stored entry (at startup); an empty one is a merged-away moved entry."""
        origin, client_id = _split_key(key)
        if origin is None:
            self.main.load(client_id, data)
        elif data:
            moved = self.moved.setdefault(origin, PushLedger(self._window, self._max_clients))
            moved.load(client_id, data)
            low, ranges = PushLedger.decode(data)
            self._high[(origin, client_id)] = max([low, *(b for _, b in ranges)])

    def take_changed(self) -> list[tuple[str, bytes]]:
        """``(stored name, entry)`` of every entry changed since the last call (to write
        them out); merged-away moved entries come as empty ones."""
        out = [(c, self.main.encode(c)) for c in self.main.take_changed()]
        for origin, moved in list(self.moved.items()):
            out += [(moved_key(origin, c), moved.encode(c)) for c in moved.take_changed()]
        with self._lock:
            merged, self._merged = sorted(self._merged), set()
        return out + [(key, b"") for key in merged]

    def mark_changed(self, keys: list[str]) -> None:
        """Put back the entries ``take_changed`` gave whose write failed."""
        for key in keys:
            origin, client_id = _split_key(key)
            if origin is None:
                self.main.mark_changed([client_id])
            elif origin in self.moved and self.moved[origin].knows(client_id):
                self.moved[origin].mark_changed([client_id])
            else:
                with self._lock:
                    self._merged.add(key)

    def has_changes(self) -> bool:
        with self._lock:
            merged = bool(self._merged)
        return merged or self.main.has_changes() or any(m.has_changes() for m in self.moved.values())

    def entries(self) -> list[tuple[str, bytes]]:
        """Every entry, main and moved, by stored name."""
        out = [(c, self.main.encode(c)) for c in self.main.clients()]
        for origin, moved in list(self.moved.items()):
            out += [(moved_key(origin, c), moved.encode(c)) for c in moved.clients()]
        return out


@dataclass(frozen=True)
class KeyOrigins:
    """Where the keys of one push entry were before the last reshard that brought this
    shard keys, to record the push in the right ledger (``TableLedgers``).

    ``owners``: each key's shard before it (the push was planned under the new map, and
    is recorded for every origin in ``origins`` and this shard, ``index``, keys or not:
    it held all of their keys the shard owns); or ``fixed`` for all of them (the push
    was planned for shard ``fixed`` before the reshard, None: for this shard).
    """

    index: int
    fixed: int | None = None
    owners: npt.NDArray[np.int32] | None = None
    origins: tuple[int, ...] = ()
    skip: bool = False  # recorded nowhere here (an empty part of another shard's push)

    def groups(self, n: int) -> list[tuple[int | None, npt.NDArray[np.bool_] | None]]:
        """``(origin, which keys)`` per ledger to record in: None = this shard's own,
        a mask of None = all ``n`` keys."""
        if self.owners is None:
            return [(self.fixed if self.fixed != self.index else None, None)]
        out: list[tuple[int | None, npt.NDArray[np.bool_] | None]] = [(None, self.owners == self.index)]
        out += [(o, self.owners == o) for o in self.origins]
        return out
