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

__all__ = ["KeyOrigins", "PushLedger", "PushRecord", "TableLedgers", "moved_key"]


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

    def has(self, client_id: str, seq: int) -> bool:
        """Whether ``(client_id, seq)`` was applied (asking creates no entry)."""
        with self._cond:
            c = self._clients.get(client_id)
            return c is not None and c.has(seq)

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


_POST = "post"


def moved_key(origin: int, client_id: str) -> str:
    """The stored name of ``client_id``'s entry in the ledger of keys that came from shard
    ``origin`` (client ids are printable, so the leading NUL never meets one)."""
    return f"\0{origin}\0{client_id}"


def _post_key(client_id: str) -> str:
    return f"\0{_POST}\0{client_id}"


def _split_key(key: str) -> tuple[str | None, str]:
    """``(scope, client_id)`` of a stored name: scope None (the shard's own), ``"post"``,
    or an origin shard's number as text."""
    if key.startswith("\0"):
        scope, client_id = key[1:].split("\0", 1)
        return scope, client_id
    return None, key


def _applied(entry: tuple[int, list[tuple[int, int]]] | None) -> list[tuple[int, int]]:
    """The seqs an entry holds as sorted, merged ranges."""
    if entry is None:
        return []
    low, ranges = entry
    return _merge_ranges(([(1, low)] if low else []) + ranges)


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class TableLedgers:
    """A table's exactly-once records: its own ``PushLedger`` (``main``) and, after a
    reshard that brought it keys, those of the shards they came from (``pre``) and one
    of the pushes planned after it (``post``).

    A push is applied once per key. Around a reshard a push may reach the new owner of
    some keys in several parts (one per shard it was first planned for, routed again),
    or again as a whole (a trainer resumed from its checkpoint); so each key's pushes
    are the ones its group's ledger records (``main`` for this shard's own keys,
    ``pre[origin]`` for keys that came from ``origin``) plus those in ``post``, which
    records only pushes planned after the reshard: each of those reached this shard as
    one request holding all of its keys here. A push planned before it is recorded in
    the ledger of the shard it was planned for.

    Once the reshard is ``settle_s`` old (longer than a client retries) and every
    client's pushes agree across the groups, the records collapse into ``main`` again
    (``collapse``); ``pending`` counts what still keeps them apart (a new reshard waits
    for 0). Stored entries are named by ``client_id`` (``main``), ``moved_key(origin,
    client_id)`` (``pre``) and ``"\0post\0" + client_id``; an empty one stored is one
    that went away.

    Not thread-safe: the table calls it under its lock, except ``pending``.

    Example:
        >>> ledgers = TableLedgers()
        >>> ledgers.import_moved(1, {"w": PushLedger.pack(5, [])})
        >>> ledgers.activate(native_keys=False, since=0.0)
        >>> ledgers.applied("w", 5, origin=1), ledgers.applied("w", 5, origin=None)
        (True, False)
    """

    def __init__(self, window: int = 1 << 16, max_clients: int = 1 << 16) -> None:
        self.main = PushLedger(window, max_clients)
        self.pre: dict[int, PushLedger] = {}
        self.post: PushLedger | None = None
        self._native_keys = True
        self._since = 0.0
        self._stored_post: PushLedger | None = None  # loaded before the reshard activates it
        self._gone: set[str] = set()  # stored names whose entries went away, not yet written so
        self._window, self._max_clients = window, max_clients
        self._lock = threading.Lock()

    def _new(self) -> PushLedger:
        return PushLedger(self._window, self._max_clients)

    @property
    def duplicates(self) -> int:
        post = self.post.duplicates if self.post is not None else 0
        return self.main.duplicates + post + sum(m.duplicates for m in self.pre.values())

    @property
    def active(self) -> bool:
        """Whether a reshard's records are kept apart (``post`` is in use)."""
        return self.post is not None

    def group(self, origin: int | None) -> PushLedger:
        """The ledger of keys from ``origin`` (None: this shard's own)."""
        if origin is None:
            return self.main
        moved = self.pre.get(origin)
        if moved is None:
            moved = self.pre[origin] = self._new()
        return moved

    def applied(self, client_id: str, seq: int, origin: int | None) -> bool:
        """Whether ``(client_id, seq)`` was applied to the keys from ``origin`` (None: this
        shard's own): in their group's ledger, or in ``post``."""
        ledger = self.main if origin is None else self.pre.get(origin)
        if ledger is not None and ledger.has(client_id, seq):
            return True
        return self.post is not None and self.post.has(client_id, seq)

    def record_for(self, client_id: str, seq: int, keys: int, origins: KeyOrigins | None) -> PushRecord | None:
        """Where a push of ``keys`` keys is recorded, and which of them take it; None when
        it was applied before. The exactly-once choice, in one place: a push planned
        before the last reshard goes by the ledger of the shard it was planned for, one
        planned after it by ``post``, each key taking it unless its group had it (see the
        class docstring); without a reshard kept apart, by ``main``. ``seq`` 0: never
        deduplicated. Call it under the table's lock, and apply the push inside the
        record's ``claim``."""
        if origins is None or self.post is None:
            return PushRecord(self.main, client_id)
        if origins.fixed is not None:  # planned before the reshard: that shard's record
            if seq and self.post.has(client_id, seq):
                return None
            group = None if origins.fixed == origins.index else origins.fixed
            ledger = self.group(group)
            name = client_id if group is None else moved_key(group, client_id)
            return PushRecord(ledger, name)
        fresh = None
        if seq and origins.owners is not None:  # planned after: each key's group may have had it
            fresh = np.ones(keys, np.bool_)
            for owner in np.unique(origins.owners).tolist():
                if self.applied(client_id, seq, None if owner == origins.index else owner):
                    fresh[origins.owners == owner] = False
        return PushRecord(self.post, _post_key(client_id), fresh)

    # -- a reshard ---------------------------------------------------------------------

    def import_moved(self, origin: int, entries: dict[str, bytes]) -> None:
        """Take the ledger entries of shard ``origin`` whose keys move here (at a reshard's
        freeze). Kept apart (in ``pre``) once the reshard commits (``activate``)."""
        moved = self._new()
        for client_id, data in entries.items():
            moved.load(client_id, data)
            moved.mark_changed([client_id])
        with self._lock:
            self.pre[origin] = moved

    def drop_moved(self) -> None:
        """Forget what reshard imports brought (an aborted reshard)."""
        with self._lock:
            for origin, moved in self.pre.items():
                self._gone.update(moved_key(origin, c) for c in moved.clients())
            self.pre = {}

    def activate(self, *, native_keys: bool, since: float) -> None:
        """The reshard that brought keys committed at ``since`` (unix s): keep the records
        apart until ``collapse``. ``native_keys``: this shard had keys of its own before."""
        with self._lock:
            if self.post is None:
                self.post = self._stored_post or self._new()
            self._native_keys, self._since = native_keys, since

    def pending(self, now: float | None = None, settle_s: float = 0.0) -> int:
        """Clients whose records still differ across groups (+1 while the reshard is
        younger than ``settle_s``); 0 when nothing is kept apart."""
        with self._lock:
            if self.post is None:
                return 0
            young = 1 if now is not None and now - self._since < settle_s else 0
            return young + len(self._differing())

    def _differing(self) -> list[str]:
        assert self.post is not None
        groups = list(self.pre.values()) + ([self.main] if self._native_keys else [])
        clients = set(self.post.clients()).union(*(g.clients() for g in groups))
        out = []
        for c in sorted(clients):
            post = _applied(self.post.entry(c))
            seen = {tuple(_merge_ranges(_applied(g.entry(c)) + post)) for g in groups}
            if len(seen) > 1:
                out.append(c)
        return out

    def collapse(self, now: float, settle_s: float) -> bool:
        """Merge the records back into ``main`` if the reshard is ``settle_s`` old and every
        client's pushes agree across groups; True if nothing is kept apart now."""
        with self._lock:
            if self.post is None:
                return True
            if now - self._since < settle_s or self._differing():
                return False
            post, groups = self.post, list(self.pre.values()) + [self.main]
            for c in sorted(set(post.clients()).union(*(g.clients() for g in groups))):
                merged = _merge_ranges(
                    _applied(post.entry(c)) + _applied(next((g.entry(c) for g in groups if g.knows(c)), None))
                )
                low = merged[0][1] if merged and merged[0][0] == 1 else 0
                self.main.load(c, PushLedger.pack(low, [r for r in merged if r[0] > low + 1]))
                self.main.mark_changed([c])
            self._gone.update(_post_key(c) for c in post.clients())
            for origin, moved in self.pre.items():
                self._gone.update(moved_key(origin, c) for c in moved.clients())
            self.post, self._stored_post, self.pre = None, None, {}
            return True

    # -- what the table writes --------------------------------------------------------

    def load(self, key: str, data: bytes) -> None:
        """Restore a stored entry (at startup)."""
        scope, client_id = _split_key(key)
        if not data:
            return
        if scope is None:
            self.main.load(client_id, data)
        elif scope == _POST:
            if self._stored_post is None:
                self._stored_post = self._new()
            self._stored_post.load(client_id, data)
        else:
            self.group(int(scope)).load(client_id, data)

    def take_changed(self) -> list[tuple[str, bytes]]:
        """``(stored name, entry)`` of every entry changed since the last call (to write
        them out); entries that went away come as empty ones."""
        out = [(c, self.main.encode(c)) for c in self.main.take_changed()]
        if self.post is not None:
            out += [(_post_key(c), self.post.encode(c)) for c in self.post.take_changed()]
        for origin, moved in list(self.pre.items()):
            out += [(moved_key(origin, c), moved.encode(c)) for c in moved.take_changed()]
        with self._lock:
            gone, self._gone = sorted(self._gone), set()
        return out + [(key, b"") for key in gone]

    def mark_changed(self, keys: list[str]) -> None:
        """Put back the entries ``take_changed`` gave whose write failed."""
        for key in keys:
            scope, client_id = _split_key(key)
            ledger = self.main if scope is None else self.post if scope == _POST else self.pre.get(int(scope))
            if ledger is not None and ledger.knows(client_id):
                ledger.mark_changed([client_id])
            else:
                with self._lock:
                    self._gone.add(key)

    def has_changes(self) -> bool:
        with self._lock:
            gone = bool(self._gone)
        ledgers = [self.main, *self.pre.values(), *([self.post] if self.post is not None else [])]
        return gone or any(m.has_changes() for m in ledgers)

    def entries(self) -> list[tuple[str, bytes]]:
        """Every entry, by stored name."""
        out = [(c, self.main.encode(c)) for c in self.main.clients()]
        if self.post is not None:
            out += [(_post_key(c), self.post.encode(c)) for c in self.post.clients()]
        for origin, moved in list(self.pre.items()):
            out += [(moved_key(origin, c), moved.encode(c)) for c in moved.clients()]
        return out


@dataclass(frozen=True)
class PushRecord:
    """Where one push is recorded (``TableLedgers.record_for``): the ledger, the entry's
    stored name, and which of its keys take it (None: all)."""

    ledger: PushLedger
    name: str
    fresh: npt.NDArray[np.bool_] | None = None


@dataclass(frozen=True)
class KeyOrigins:
    """Which records a push entry goes by on shard ``index`` after a reshard brought it
    keys (``TableLedgers``): a push planned after the reshard names each key's shard
    before it (``owners``); one planned before names the shard it was planned for
    (``fixed``); a part of another shard's push that holds no key here is recorded
    nowhere (``skip``)."""

    index: int
    fixed: int | None = None
    owners: npt.NDArray[np.int32] | None = None
    origins: tuple[int, ...] = ()
    skip: bool = False
