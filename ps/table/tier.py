"""The disk half of a table: its rows in RocksDB, and spills of rows out of RAM.

``DiskTier`` holds a table's column family (``TableRows``) and its data directory
(``Storage``), and the table's *write lock*, which puts RocksDB writes in the order
their copies were taken. ``Table`` (``ps.table``) owns the table lock and calls this
half; nothing here takes the table lock.

RocksDB writes happen outside the table lock where they can. A ``Spill`` (an
eviction, or one chunk of an interval flush) runs in three steps, which the table
drives:

1. under the table lock: ``Spill.take`` copies the rows and the ledger entries changed
   since the last write and marks the rows ``WRITING``; the table takes the write
   lock, then releases the table lock;
2. ``DiskTier.write_spill`` writes the copies (lookups and pushes of the table go on
   meanwhile); the table releases the write lock;
3. under the table lock again: ``Spill.settle`` makes clean the rows no push changed
   meanwhile, and an eviction drops from RAM the rows nothing touched meanwhile.

A push turns a ``WRITING`` row back to ``DIRTY``, so it is written again later; a
touched row stays resident, as it is no longer among the least recently used. Every
writer of the table's rows takes the write lock while it holds the table lock, so
RocksDB receives writes in the order their copies were taken, and a row's on-disk
copy never goes back in time.

Example:
    >>> import tempfile, pathlib
    >>> from ps.store import Storage
    >>> from ps.store import RowFormat, Rows
    >>> st = Storage(pathlib.Path(tempfile.mkdtemp()), shard=0, num_shards=1)
    >>> disk = DiskTier(st.table("t", RowFormat(dim=2, state_width=0)), st)
    >>> with disk.write_lock:
    ...     disk.commit_push(Rows(np.array([4]), np.ones((1, 2), np.float32), np.empty((1, 0), np.float32),
    ...                           np.zeros(1, np.uint32), np.zeros(1, np.uint32)), None)
    >>> disk.read(np.array([4, 5]))[0].tolist()
    [True, False]
    >>> st.close()
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ps.store import Rows, Storage, TableRows
from ps.table.ram import CLEAN, DIRTY, WRITING, RamTier

__all__ = ["DiskTier", "Spill", "SpillOutcome", "write_rows"]

# Rows per RocksDB write of a spill: rocksdict holds the GIL while it writes (a few ms for
# this many), and longer sorted runs make memtable inserts cheaper.
SPILL_CHUNK = 1 << 13
_HELD_CHUNK = 1 << 16  # rows per batch when the table lock is held anyway (checkpoints, copies)


@dataclass(frozen=True)
class SpillOutcome:
    """What step 3 of a spill did: rows written, and rows dropped from RAM (spilled to
    disk, or deleted as rare)."""

    written: int = 0
    spilled: int = 0
    deleted_rare: int = 0


@dataclass
class Spill:
    """Rows copied under the table lock, to be written after it is released."""

    keys: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int32]
    write: npt.NDArray[np.bool_]  # rows written
    delete: npt.NDArray[np.bool_]  # rows deleted (rare ones); the rest are clean already
    rows: Rows  # copies of the rows written
    seen_access: npt.NDArray[np.uint32]  # of every row, to tell which were touched meanwhile
    seen_frequency: npt.NDArray[np.uint32]
    changed: list[str] = field(default_factory=list)  # ledger clients written along
    ledger: list[tuple[str, bytes]] = field(default_factory=list)

    @classmethod
    def take(
        cls,
        ram: RamTier,
        keys: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int32],
        write: npt.NDArray[np.bool_],
        delete: npt.NDArray[np.bool_],
        ledger: list[tuple[str, bytes]],
    ) -> Spill:
        """Step 1: copy the rows at ``slots`` (those to ``write``) with the ``ledger``
        entries ``(client_id, bytes)`` to write along, and mark them ``WRITING``."""
        a = ram.arena
        spill = cls(
            keys,
            slots,
            write,
            delete,
            a.rows(keys[write], slots[write]),
            a.last_access[slots],
            a.frequency[slots],
            [c for c, _ in ledger],
            ledger,
        )
        a.dirty[slots[write | delete]] = WRITING
        return spill

    def settle(self, ram: RamTier, ok: bool, evict: bool) -> SpillOutcome:
        """Step 3: after the write (``ok``: it succeeded), mark what was written clean and,
        for an eviction, drop from RAM the rows nothing touched meanwhile."""
        a = ram.arena
        slots = self.slots
        # A key may have left meanwhile (TTL, remove) and its slot gone to another key.
        same = ram.slots(self.keys) == slots
        writing = same & (a.dirty[slots] == WRITING)
        if not ok:
            # Written or not, these are rewritten later; a deleted rare row is kept.
            a.dirty[slots[writing]] = DIRTY
            return SpillOutcome()
        a.dirty[slots[writing]] = CLEAN
        written = int(self.write.sum())
        if not evict:
            return SpillOutcome(written=written)
        untouched = (
            same
            & (a.last_access[slots] == self.seen_access)
            & (a.frequency[slots] == self.seen_frequency)
            & (a.dirty[slots] == CLEAN)
        )
        # A rare row deleted on disk but used meanwhile stays, and must be written again.
        a.dirty[slots[same & ~untouched & self.delete]] = DIRTY
        gone = self.keys[untouched]
        ram.remove(gone)
        rare = int((untouched & self.delete).sum())
        return SpillOutcome(written=written, spilled=int(gone.shape[0]) - rare, deleted_rare=rare)


class DiskTier:
    """The RocksDB half of a table (see the module docstring). ``write_lock``: taken by
    every writer of the table's rows while it holds the table lock; ``commit_push``,
    ``write_held`` and ``delete`` expect the caller to hold it. Reads need no lock."""

    def __init__(self, rows: TableRows, storage: Storage) -> None:
        self.rows = rows
        self.storage = storage
        self.write_lock = threading.Lock()
        self.estimated = False  # a table's row count started from estimate_rows(): it is approximate

    def estimate_rows(self) -> int:
        """RocksDB's estimate of the rows stored (exact only after a compaction); sets
        ``estimated`` once it counts any (the table then counts from an estimate)."""
        rows = self.rows.estimate_rows()
        self.estimated = self.estimated or rows > 0
        return rows

    def disk_bytes(self) -> int:
        return self.rows.disk_bytes()

    def ledgers(self) -> dict[str, bytes]:
        """Every client's stored push-ledger entry for this table."""
        return self.rows.ledgers()

    def read(self, keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.bool_], Rows]:
        """Which of the distinct, sorted ``keys`` are stored, and their rows. One multi-get."""
        return self.rows.get(keys)

    def scan(self) -> Iterator[Rows]:
        """Every stored row, in chunks."""
        return self.rows.scan()

    def write_spill(self, spill: Spill) -> None:
        """Step 2 of a spill: its ledger entries, deletions and rows, in chunks (each a
        batch). ``StorageFailed``: some chunks may be written; the spill is settled as failed."""
        rows, storage = self.rows, self.storage
        n = len(spill.rows)
        if not (n or spill.ledger or spill.delete.any()):
            return  # clean rows only: nothing to write (a read-only serving shard evicts so)
        for start in range(0, max(n, 1), SPILL_CHUNK):
            batch = storage.batch()
            if start == 0:
                for client_id, data in spill.ledger:
                    rows.put_ledger(batch, client_id, data)
                rows.delete(batch, spill.keys[spill.delete])
            rows.put(batch, spill.rows[start : start + SPILL_CHUNK])
            storage.commit(batch)

    def write_held(
        self, ram: RamTier, keys: npt.NDArray[np.int64], slots: npt.NDArray[np.int32], ledger: list[tuple[str, bytes]]
    ) -> Iterator[npt.NDArray[np.int32]]:
        """Write the RAM rows at ``slots`` and the ``ledger`` entries (in the first batch)
        straight from the arena, in batches; yields each batch's slots once committed.
        Caller holds the table lock and the write lock."""
        return write_rows(ram, keys, slots, ledger, self.rows, self.storage)

    def commit_push(self, rows: Rows, ledger: tuple[str, bytes] | None) -> None:
        """Write one push's updated ``rows`` and its ledger entry in one batch (every-push mode)."""
        batch = self.storage.batch()
        if ledger is not None:
            self.rows.put_ledger(batch, *ledger)
        self.rows.put(batch, rows)
        self.storage.commit(batch)

    def push_durably(
        self,
        ram: RamTier,
        keys: npt.NDArray[np.int64],
        grads: npt.NDArray[np.float32],
        slots: npt.NDArray[np.int32],
        now: np.uint32,
        ledger: tuple[str, bytes] | None,
    ) -> int:
        """Every-push mode: write the distinct rows at ``slots`` as ``grads`` update them,
        with the push's ``ledger`` entry (one batch), and only then install them in RAM
        (``CLEAN``); returns rows written. ``StorageFailed``: RAM is exactly as it was.
        Caller holds the table lock."""
        rows = ram.updated_rows(keys, slots, grads, now)
        with self.write_lock:
            self.commit_push(rows, ledger)
        ram.store(slots, rows)
        return int(slots.shape[0])

    def write_created(self, ram: RamTier, keys: npt.NDArray[np.int64], slots: npt.NDArray[np.int32]) -> int:
        """Every-push mode: write the rows a lookup of ``keys`` (at ``slots``) just created,
        in one batch, before it returns them; returns rows written. In this mode a
        ``DIRTY`` row is one a lookup created (a push writes before it applies).
        ``StorageFailed``: nothing written, and the rows are dropped from RAM again
        (their ``slots`` set to -1). Caller holds the table lock."""
        a = ram.arena
        held = np.flatnonzero(slots >= 0)
        new = held[a.dirty[slots[held]] == DIRTY]
        k = np.unique(keys[new])
        s = ram.slots(k)
        try:
            with self.write_lock:
                self.commit_push(a.rows(k, s), None)
        except BaseException:
            ram.remove(k)
            slots[new] = -1
            raise
        ram.mark(s, CLEAN)
        return int(k.shape[0])

    def delete(self, keys: npt.NDArray[np.int64]) -> None:
        """Delete the rows of ``keys`` (one batch)."""
        batch = self.storage.batch()
        self.rows.delete(batch, keys)
        self.storage.commit(batch)


def write_rows(
    ram: RamTier,
    keys: npt.NDArray[np.int64],
    slots: npt.NDArray[np.int32],
    ledger: list[tuple[str, bytes]],
    rows: TableRows,
    storage: Storage,
) -> Iterator[npt.NDArray[np.int32]]:
    """Write the RAM rows at ``slots`` with the ``ledger`` entries (first batch) to ``rows``
    in ``storage``; yields each batch's slots once committed (see ``DiskTier.write_held``)."""
    a = ram.arena
    for start in range(0, max(keys.shape[0], 1), _HELD_CHUNK):
        batch = storage.batch()
        for client_id, data in ledger if start == 0 else ():
            rows.put_ledger(batch, client_id, data)
        k, s = keys[start : start + _HELD_CHUNK], slots[start : start + _HELD_CHUNK]
        rows.put(batch, a.rows(k, s))
        storage.commit(batch)
        yield s
