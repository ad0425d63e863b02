"""One shard: its tables by name, its place in the cluster, and exactly-once pushes.

``Shard`` is what the gRPC servicer talks to, and what tests can drive without a
network. It checks that a request was routed for this cluster's size, resolves table
names, and records which ``(client_id, seq)`` pushes it has applied so that a push
retried after a timeout is not applied twice.

Example:
    >>> from ps.config import TableSpec
    >>> shard = Shard(index=0, num_shards=1)
    >>> shard.create_table(TableSpec("item", dim=8))
    True
    >>> shard.table("item").dim
    8
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from ps.config import TableSpec
from ps.errors import InvalidRequest, ShardMismatch, ShuttingDown, TableExists, UnknownTable, WrongMode
from ps.table import Table

__all__ = ["PushLedger", "Shard"]

log = logging.getLogger(__name__)


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
                self._cond.notify_all()

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


class Shard:
    """Tables and cluster identity of one shard. Thread-safe."""

    def __init__(self, index: int, num_shards: int) -> None:
        if not 0 <= index < num_shards:
            raise ValueError(f"shard={index}: not in [0, num_shards={num_shards})")
        self.index = index
        self.num_shards = num_shards
        self.mode = "train"
        self.ledger = PushLedger()
        self.started = time.monotonic()
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._closing = False

    def create_table(self, spec: TableSpec) -> bool:
        """Create ``spec``'s table; False if an identical one exists.

        Raises ``TableExists`` naming every differing field if the name is taken by
        another spec.
        """
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                diff = existing.spec.differences(spec)
                if diff:
                    raise TableExists(
                        f"table {spec.name!r} exists with a different spec: {'; '.join(diff)} "
                        "(existing != requested)"
                    )
                return False
            self._tables[spec.name] = Table(spec)
        log.info("table created name=%s dim=%d optimizer=%s", spec.name, spec.dim, spec.optimizer.kind.name)
        return True

    def table(self, name: str) -> Table:
        """The table called ``name``; raises ``UnknownTable`` listing the ones that exist."""
        try:
            return self._tables[name]
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise UnknownTable(f"table {name!r} does not exist on shard {self.index} (tables: {known})") from None

    def tables(self) -> list[Table]:
        """Every table, sorted by name."""
        with self._lock:
            return [self._tables[n] for n in sorted(self._tables)]

    def check_request(self, num_shards: int, shard: int | None = None) -> None:
        """Raise unless a request routed for ``num_shards`` shards (to ``shard``) may run here now."""
        if self._closing:
            raise ShuttingDown(f"shard {self.index} is shutting down")
        if shard is not None and shard != self.index:
            raise ShardMismatch(
                f"request for shard {shard} reached shard {self.index}: the client's address list "
                "is not in shard order"
            )
        if num_shards and num_shards != self.num_shards:
            raise ShardMismatch(
                f"request was routed for num_shards={num_shards}, but shard {self.index} belongs to a "
                f"cluster of {self.num_shards}: the client's address list does not match the cluster"
            )

    def check_writable(self) -> None:
        """Raise ``WrongMode`` if this shard refuses pushes (serving mode)."""
        if self.mode != "train":
            raise WrongMode(f"shard {self.index} is read-only (mode={self.mode}): pushes are refused")

    def close(self) -> None:
        """Refuse new requests from now on (in-flight ones finish)."""
        self._closing = True

    @staticmethod
    def check_table_field(name: str, field: str) -> None:
        """Raise ``InvalidRequest`` if a request entry has no table name."""
        if not name:
            raise InvalidRequest(f"{field}: table name is empty")
