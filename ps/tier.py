"""Moving a table's rows between RAM and its column family: eviction, flushes, expiry.

``DiskTier`` is mixed into ``Table``, which owns what it works on (the lock, the key
index, the arena, the ledger, the column family); ``ps.table`` has the contract.

RocksDB writes happen outside the table lock where they can. A *spill* (an eviction,
or one chunk of an interval flush) runs in three steps:

1. under the table lock: copy the rows and the ledger entries changed since the last
   write, mark the rows ``WRITING``, take the table's write lock, release the table lock;
2. write the copies (lookups and pushes of this table go on meanwhile);
3. under the table lock again: rows that no push changed meanwhile become clean, and
   an eviction drops from RAM the rows that nothing touched meanwhile.

A push turns a ``WRITING`` row back to ``DIRTY``, so it is written again later; a
touched row stays resident, as it is no longer among the least recently used. Every
writer of the table's rows takes the write lock while it holds the table lock, so
RocksDB receives writes in the order their copies were taken, and a row's on-disk
copy never goes back in time. One spill per table at a time (``_spill_lock``, taken
before the table lock); a checkpoint's flush takes the table lock and then the write
lock, so it waits for a spill's write but never for its last step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numba
import numpy as np
import numpy.typing as npt

from ps.arena import Arena
from ps.config import TableSpec
from ps.keyindex import KeyIndex
from ps.ledger import PushLedger
from ps.lifecycle import age_histogram, expired_keys, now_tick, select_victims
from ps.storage import Storage, TableRows

if TYPE_CHECKING:
    from ps.table import TableCounters

__all__ = ["CLEAN", "DIRTY", "WRITING", "DiskTier"]

CLEAN, DIRTY, WRITING = 0, 1, 2  # arena.dirty: on disk as in RAM / changed since / being written
# Rows per RocksDB write of a spill: rocksdict holds the GIL while it writes (a few ms for
# this many), and longer sorted runs make memtable inserts cheaper.
_SPILL_CHUNK = 1 << 13
_LOCKED_CHUNK = 1 << 16  # rows per batch when the table lock is held anyway (checkpoints, copies)


@numba.njit(nogil=True, cache=True)
def _collect_dirty(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    dirty: npt.NDArray[np.uint8],
    out_keys: npt.NDArray[np.int64],
    out_slots: npt.NDArray[np.int32],
) -> int:
    """Fill ``out_*`` with up to their length of rows not ``CLEAN``; returns how many
    there are in all (which may be more)."""
    n = 0
    for i in range(tslots.shape[0]):
        s = tslots[i]
        if s >= 0 and dirty[s] != CLEAN:
            if n < out_keys.shape[0]:
                out_keys[n] = tkeys[i]
                out_slots[n] = s
            n += 1
    return n


@dataclass
class _Spill:
    """Rows copied under the table lock, to be written after it is released."""

    keys: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int32]
    write: npt.NDArray[np.bool_]  # rows written
    delete: npt.NDArray[np.bool_]  # rows deleted (rare ones); the rest are clean already
    values: npt.NDArray[np.float32]
    state: npt.NDArray[np.float32]
    last_access: npt.NDArray[np.uint32]
    frequency: npt.NDArray[np.uint32]
    seen_access: npt.NDArray[np.uint32]  # of every row, to tell which were touched meanwhile
    seen_frequency: npt.NDArray[np.uint32]
    changed: list[str] = field(default_factory=list)  # ledger clients written along
    ledger: list[tuple[str, bytes]] = field(default_factory=list)


class DiskTier:
    """The RAM <-> RocksDB half of ``Table`` (see the module docstring)."""

    # Set by Table.__init__.
    spec: TableSpec
    counters: TableCounters
    ledger: PushLedger
    spilled: int
    _lock: threading.Lock
    _write_lock: threading.Lock
    _spill_lock: threading.Lock
    _index: KeyIndex
    _arena: Arena
    _rows: TableRows | None
    _storage: Storage | None

    def _disk(self) -> tuple[TableRows, Storage]:
        if self._rows is None or self._storage is None:
            raise RuntimeError(f"table {self.spec.name!r} has no storage to evict to (start with --data-dir)")
        return self._rows, self._storage

    def age_histogram(self, now: np.uint32) -> npt.NDArray[np.int64]:
        """Resident rows by age in ticks (see ``ps.lifecycle.age_histogram``)."""
        with self._lock:
            return age_histogram(self._index.buckets()[1], self._arena.last_access, now)

    # -- eviction ------------------------------------------------------------------------

    def evict(self, count: int, now: np.uint32 | None = None, hist: npt.NDArray[np.int64] | None = None) -> int:
        """Move up to ``count`` least recently used rows out of RAM; returns how many left.

        Rows looked up fewer than ``lifecycle.evict_below_frequency`` times are deleted
        (from RAM and disk); the rest are written to disk if dirty, then dropped from
        RAM; rows used while they were being written stay. ``hist``: this table's
        ``age_histogram(now)``, if the caller has it. Needs storage. ``StorageFailed``:
        nothing left RAM.
        """
        self._disk()
        now = now_tick() if now is None else now
        lifecycle = self.spec.lifecycle
        with self._spill_lock:
            with self._lock:
                a = self._arena
                keys, slots = select_victims(*self._index.buckets(), a.last_access, now, count, hist)
                if not keys.size:
                    return 0
                floor = lifecycle.evict_below_frequency
                rare = a.frequency[slots] < floor if floor else np.zeros(keys.shape[0], np.bool_)
                write = ~rare
                if not (floor or lifecycle.ttl_seconds):
                    # Lookups change only access time and count, which nothing reads back
                    # from disk unless a lifecycle rule does: a clean row need not be rewritten.
                    write &= a.dirty[slots] != CLEAN
                spill = self._begin_spill(keys, slots, write, rare)
            return self._run_spill(spill, evict=True)

    # -- flushes -------------------------------------------------------------------------

    def flush(self, metadata: bool = False) -> int:
        """Write every dirty row, with the ledger, to disk; returns rows written.

        Without ``metadata`` (the interval flush) the rows go in chunks, each a spill
        (lookups and pushes continue while it is written; each chunk carries the ledger
        entries changed up to its copy, so no row on disk reflects a push the ledger on
        disk lacks). ``metadata``: a consistent cut under one lock hold, and in a table
        with a TTL or a frequency floor rows that were only looked up are written too,
        so that their access time and count on disk are current (checkpoints and clean
        shutdowns). ``StorageFailed``: the rows not yet written stay dirty.
        """
        if self._rows is None or self._storage is None:
            return 0
        if metadata:
            with self._lock:
                return self._flush_locked(metadata=True)
        with self._lock:
            dirty_keys = np.empty(len(self._index), np.int64)
            n = _collect_dirty(*self._index.buckets(), self._arena.dirty, dirty_keys, np.empty(len(self._index), np.int32))
        written = 0
        for start in range(0, max(n, 1), _SPILL_CHUNK):  # rows dirtied since wait for the next flush
            with self._spill_lock:
                with self._lock:
                    keys = dirty_keys[start : min(n, start + _SPILL_CHUNK)]
                    slots = self._index.lookup(keys)
                    live = slots >= 0
                    live[live] = self._arena.dirty[slots[live]] != CLEAN
                    keys, slots = keys[live], slots[live]
                    if not keys.size and not self.ledger.has_changes():
                        continue
                    spill = self._begin_spill(keys, slots, np.ones(keys.shape[0], np.bool_), np.zeros(keys.shape[0], np.bool_))
                written += self._run_spill(spill, evict=False)
        return written

    def _flush_locked(self, metadata: bool = False) -> int:
        """``flush`` for a caller holding the table lock (a checkpoint holds every table's)."""
        if self._rows is None or self._storage is None:
            return 0
        rows, storage = self._rows, self._storage
        a = self._arena
        lc = self.spec.lifecycle
        with self._write_lock:  # after any spill's write: this one is the newer copy
            if metadata and (lc.ttl_seconds or lc.evict_below_frequency):
                keys, slots = self._index.items()
                n = int(keys.shape[0])
            else:
                keys = np.empty(len(self._index), np.int64)
                slots = np.empty(len(self._index), np.int32)
                n = _collect_dirty(*self._index.buckets(), a.dirty, keys, slots)
            changed = self.ledger.take_changed()
            if n == 0 and not changed:
                return 0
            try:
                for s in self._write_rows_locked(rows, storage, slots[:n], keys[:n], changed):
                    self.counters.rows_written += s.shape[0]
                    a.dirty[s] = CLEAN
                    changed = []
            finally:
                self.ledger.mark_changed(changed)
            return n

    def _write_rows_locked(
        self,
        rows: TableRows,
        storage: Storage,
        slots: npt.NDArray[np.int32],
        keys: npt.NDArray[np.int64],
        clients: list[str],
    ) -> Iterator[npt.NDArray[np.int32]]:
        """Write the RAM rows at ``slots`` and the ledger entries of ``clients`` (in the
        first batch) to ``rows``, in batches; yields each batch's slots once committed.
        Caller holds the table lock."""
        a = self._arena
        for start in range(0, max(keys.shape[0], 1), _LOCKED_CHUNK):
            batch = storage.batch()
            for client_id in clients if start == 0 else ():
                rows.put_ledger(batch, client_id, self.ledger.encode(client_id))
            k, s = keys[start : start + _LOCKED_CHUNK], slots[start : start + _LOCKED_CHUNK]
            rows.put(batch, k, a.values[s], a.state[s], a.last_access[s], a.frequency[s])
            storage.commit(batch)
            yield s

    def unpersisted_locked(
        self,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
        """Copies of ``(keys, values, state, last_access, frequency)`` of every resident row
        that is not on disk as it is in RAM. Caller holds the table lock (a shard stopping
        with a failed disk saves these elsewhere)."""
        a = self._arena
        keys = np.empty(len(self._index), np.int64)
        slots = np.empty(len(self._index), np.int32)
        n = _collect_dirty(*self._index.buckets(), a.dirty, keys, slots)
        s = slots[:n]
        return keys[:n].copy(), a.values[s], a.state[s], a.last_access[s], a.frequency[s]

    def unpersisted_rows(self) -> int:
        """Resident rows not on disk as they are in RAM."""
        with self._lock:
            return int(_collect_dirty(*self._index.buckets(), self._arena.dirty, np.empty(0, np.int64), np.empty(0, np.int32)))

    # -- spills --------------------------------------------------------------------------

    def _begin_spill(
        self,
        keys: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int32],
        write: npt.NDArray[np.bool_],
        delete: npt.NDArray[np.bool_],
    ) -> _Spill:
        """Step 1 (caller holds the spill lock and the table lock; returns holding the
        write lock too)."""
        a = self._arena
        w = slots[write]
        changed = self.ledger.take_changed()
        spill = _Spill(
            keys, slots, write, delete, a.values[w], a.state[w], a.last_access[w], a.frequency[w],
            a.last_access[slots], a.frequency[slots],
            changed, [(c, self.ledger.encode(c)) for c in changed],
        )  # fmt: skip
        a.dirty[slots[write | delete]] = WRITING
        self._write_lock.acquire()
        return spill

    def _run_spill(self, spill: _Spill, evict: bool) -> int:
        """Steps 2 and 3 (caller holds the spill lock and the write lock). Returns rows
        dropped from RAM (``evict``) or written."""
        ok = False
        try:
            self._write_spill(spill)
            ok = True
        finally:
            self._write_lock.release()
            with self._lock:
                done = self._end_spill(spill, ok, evict)
        return done

    def _write_spill(self, spill: _Spill) -> None:
        rows, storage = self._disk()
        keys = spill.keys[spill.write]
        for start in range(0, max(keys.shape[0], 1), _SPILL_CHUNK):
            batch = storage.batch()
            if start == 0:
                for client_id, data in spill.ledger:
                    rows.put_ledger(batch, client_id, data)
                rows.delete(batch, spill.keys[spill.delete])
            end = start + _SPILL_CHUNK
            rows.put(
                batch, keys[start:end], spill.values[start:end], spill.state[start:end],
                spill.last_access[start:end], spill.frequency[start:end],
            )  # fmt: skip
            storage.commit(batch)

    def _end_spill(self, spill: _Spill, ok: bool, evict: bool) -> int:
        """Step 3 (caller holds the table lock)."""
        a = self._arena
        slots = spill.slots
        # A key may have left meanwhile (TTL, remove) and its slot gone to another key.
        same = self._index.lookup(spill.keys) == slots
        writing = same & (a.dirty[slots] == WRITING)
        if not ok:
            # Written or not, these are rewritten later; a deleted rare row is kept.
            a.dirty[slots[writing]] = DIRTY
            self.ledger.mark_changed(spill.changed)
            return 0
        a.dirty[slots[writing]] = CLEAN
        self.counters.rows_written += int(spill.write.sum())
        if not evict:
            return int(spill.write.sum())
        untouched = (
            same
            & (a.last_access[slots] == spill.seen_access)
            & (a.frequency[slots] == spill.seen_frequency)
            & (a.dirty[slots] == CLEAN)
        )
        # A rare row deleted on disk but used meanwhile stays, and must be written again.
        a.dirty[slots[same & ~untouched & spill.delete]] = DIRTY
        gone = spill.keys[untouched]
        self._index.remove(gone)
        n_rare = int((untouched & spill.delete).sum())
        n_spilled = int(gone.shape[0]) - n_rare
        self.spilled += n_spilled
        self.counters.rows_spilled += n_spilled
        self.counters.rows_evicted_rare += n_rare
        return int(gone.shape[0])

    # -- lifecycle -----------------------------------------------------------------------

    def expire(self, now: np.uint32 | None = None) -> int:
        """Delete rows idle for longer than ``lifecycle.ttl_seconds`` (RAM and disk);
        returns how many. A no-op when the table has no TTL."""
        ttl = self.spec.lifecycle.ttl_seconds
        if not ttl:
            return 0
        now = now_tick() if now is None else now
        removed = 0
        with self._lock:
            keys = expired_keys(*self._index.buckets(), self._arena.last_access, now, ttl)
            if keys.size:
                self._delete_stored(keys)
                self._arena.dirty[self._index.remove(keys)] = CLEAN
                removed += int(keys.size)
                self.counters.rows_expired += int(keys.size)
        if self._rows is not None:
            removed += self._expire_spilled(now, ttl)
        return removed

    def _expire_spilled(self, now: np.uint32, ttl: float) -> int:
        removed = 0
        rows, _ = self._disk()
        for keys, rec in rows.scan():
            old = expired_keys(keys, np.arange(keys.shape[0], dtype=np.int32), rec.last_access, now, ttl)
            if not old.size:
                continue
            with self._lock:
                # Recheck under the lock: the row may have come back to RAM, or been
                # rewritten with a newer access time, since the scan read it.
                candidates = old[self._index.lookup(old) < 0]
                found, fresh = rows.get(candidates)
                present = candidates[found]
                gone = expired_keys(present, np.arange(present.shape[0], dtype=np.int32), fresh.last_access, now, ttl)
                if gone.size:
                    self._delete_stored(gone)
                    self.spilled = max(0, self.spilled - int(gone.size))
                    self.counters.rows_expired += int(gone.size)
                    removed += int(gone.size)
        return removed

    def _delete_stored(self, keys: npt.NDArray[np.int64]) -> None:
        """Delete ``keys`` from disk, if the table has storage (caller holds the table lock)."""
        if self._rows is None or self._storage is None:
            return
        rows, storage = self._rows, self._storage
        with self._write_lock:
            batch = storage.batch()
            rows.delete(batch, keys)
            try:
                storage.commit(batch)
            except BaseException:
                # The rows stay; whether or not the delete reached disk, write them again
                # later, so that a clean row never lacks its copy on disk.
                slots = self._index.lookup(keys)
                self._arena.dirty[slots[slots >= 0]] = DIRTY
                raise
