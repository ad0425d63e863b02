"""One embedding table on one shard: its lock, its RAM half, its disk half, its ledger.

``Table.lookup`` returns the rows of a batch of keys, creating missing rows (in
training mode) with their deterministic initial values; ``Table.push`` applies a
batch of gradients with the table's optimizer, at most once per ``(client_id, seq)``.
Both are batch operations compiled with numba: no Python loop or object per key.

A table is composed of two halves that it calls while holding its lock: a ``RamTier``
(``ps.table.ram``: key index, arena, admission counters) and, with a data directory, a
``DiskTier`` (``ps.table.tier``: the table's RocksDB column family). With a disk the RAM half
is the hot part of a larger table: ``evict`` moves rows (by default the least often
looked up, see ``ps.table.lifecycle``), values and optimizer state, to disk; a lookup or push
that misses RAM reads them back with one multi-get before anything else happens, so a
key once created is never re-initialised. What reaches disk, and when, follows the
shard's durability mode: with ``every_push`` a push is written (rows + its ledger entry,
one batch) before it is applied in RAM, and the rows a lookup creates before it returns
them; otherwise changed rows stay dirty until ``flush`` or ``evict`` writes them. Every write of the table carries its ledger entries,
copied under the same lock hold as its rows, so no row on disk reflects a push the
ledger on disk does not know about. Eviction and the interval flush write their copies
with the table lock released (the three steps of a spill, see ``ps.table.tier``).

The table's ``Lifecycle`` adds admission (rows only for keys seen often enough),
TTL expiry (``expire``) and deletion of rare rows instead of spilling them.

Thread-safety: every public method takes the table's lock, so a table is safe to
share between gRPC handler threads; the kernels release the GIL, so different
tables work in parallel. Locks are taken in one order: the spill lock, the table
lock, the disk's write lock; across tables, in name order (``held``).

Example:
    >>> from ps.table.spec import TableSpec
    >>> t = Table(TableSpec("user", dim=4, seed=1))
    >>> rows = t.lookup(np.array([10, 11, 10]))
    >>> bool((rows[0] == rows[2]).all()), len(t)
    (True, 2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from protos.rowtypes import Rounding
from protos.wire import as_keys
from ps.store import RowFormat, Rows, Storage, StorageFailed, TableRows
from ps.table.counters import TableCounters
from ps.table.grads import check_grads
from ps.table.health import ScanResult, TableHealth
from ps.table.held import HeldTable
from ps.table.ledger import KeyOrigins, PushLedger, PushRecord, TableLedgers
from ps.table.lifecycle import Eviction, EvictionScan, expired_keys, now_tick, scan_ranks, select_victims
from ps.table.ram import CLEAN, DIRTY, RamTier
from ps.table.spec import TableSpec
from ps.table.tier import SPILL_CHUNK, DiskTier, Spill, write_rows

__all__ = ["HeldTable", "Table"]


class Table:
    """Rows of one table on this shard (see the module docstring for the contract).

    ``rows``/``storage``: the table's column family and the data directory it lives in
    (both or neither). ``every_push``: write each push before applying it, and the rows a
    lookup creates before returning them (``on_write_failure(error)`` hears a failure).
    ``health``: sample pushed rows for ``health`` (``ps.table.health``; None without).
    """

    def __init__(
        self,
        spec: TableSpec,
        initial_capacity: int = 1024,
        *,
        rows: TableRows | None = None,
        storage: Storage | None = None,
        every_push: bool = False,
        on_write_failure: Callable[[str], None] = lambda error: None,
        health: bool = True,
    ) -> None:
        if (rows is None) != (storage is None):
            raise ValueError("rows and storage go together: pass both or neither")
        self.spec = spec
        self.dim = spec.dim
        self.counters = TableCounters()
        self.ledgers = TableLedgers()
        self.spilled = 0  # rows only on disk (estimated after a restart)
        self._lock = threading.Lock()
        self._spill_lock = threading.Lock()  # one spill of this table at a time
        self._ram = RamTier(spec, initial_capacity)
        self._disk = DiskTier(rows, storage) if rows is not None and storage is not None else None
        self._every_push = every_push and self._disk is not None
        self._on_write_failure = on_write_failure
        self._keys_field = f"table {spec.name!r}: keys"
        self.health = TableHealth() if health else None
        if self._disk is not None:
            self.spilled = self._disk.estimate_rows()
            for key, data in self._disk.ledgers().items():
                self.ledgers.load(key, data)

    @property
    def ledger(self) -> PushLedger:
        """The exactly-once record of pushes to this shard's own keys (``ledgers.main``)."""
        return self.ledgers.main

    @property
    def format(self) -> RowFormat:
        """How this table's rows are laid out and stored (``spec.row_format``)."""
        return self._ram.format

    @property
    def evictable(self) -> bool:
        """Whether rows can leave RAM: the table has a data dir to spill them to."""
        return self._disk is not None

    @property
    def rows_estimated(self) -> bool:
        """Whether ``spilled`` started from RocksDB's estimate (a table reopened from disk)."""
        return self._disk is not None and self._disk.estimated

    def disk_bytes(self) -> int:
        """What the table's rows take in the data dir (0 without one)."""
        return self._disk.disk_bytes() if self._disk is not None else 0

    @property
    def rounding(self) -> Rounding:
        """Elements clamped or flushed to zero on their way to the stored 16-bit type, so far."""
        return self._ram.rounding

    def __len__(self) -> int:
        """Rows resident in RAM."""
        return len(self._ram)

    @property
    def bytes_per_row(self) -> int:
        """What one resident row costs the memory budget: arena columns plus index share."""
        return self._ram.bytes_per_row

    def resident_bytes(self) -> int:
        """Resident rows times ``bytes_per_row``, plus the admission counters."""
        return self._ram.resident_bytes()

    def admission_bytes(self) -> int:
        return self._ram.admission_bytes()

    def memory_bytes(self) -> int:
        """Bytes held by the index, the arena, admission counters and scratch space."""
        with self._lock:
            return self._ram.memory_bytes()

    # -- lookup and push -------------------------------------------------------------

    def lookup(
        self,
        keys: npt.ArrayLike,
        out: npt.NDArray[np.float32] | None = None,
        create: bool = True,
        touch: bool = True,
        initial: bool = False,
    ) -> npt.NDArray[np.float32]:
        """Rows of ``keys`` in order, written into ``out`` (``[len(keys), dim]`` float32, or
        the table's stored type: the stored bits as they are) or a new float32 array.

        With ``create`` (training), missing keys get their initial rows stored (once
        admitted; until then they read as their initial rows and nothing is stored);
        without it (serving), missing keys read as the table's ``serving_default`` (zeros,
        or their initial rows) and nothing is stored. ``touch=False`` leaves the rows'
        last use and use count as they were (for callers whose shard never reads them);
        ``initial`` reads missing keys as their initial rows without storing them (a
        training shard handing keys over in a reshard, whose new owner stores them). Raises
        ``InvalidKeys`` for keys that are not a 1-D integer array, ``ValueError`` for a
        wrong ``out``; ``StorageFailed`` if rows on disk cannot be read. In every-push mode,
        rows it creates but fails to write are not created after all (as if not admitted).
        """
        keys = as_keys(keys, self._keys_field)
        if out is None:
            out = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        elif (
            out.shape != (keys.shape[0], self.dim)
            or out.dtype not in self._ram.out_dtypes
            or not out.flags.c_contiguous
        ):
            # The gather kernel does not bounds-check: a wrong buffer would corrupt memory.
            raise ValueError(
                f"out: {out.dtype}{list(out.shape)}, expected C-contiguous float32[{keys.shape[0]}, {self.dim}]"
            )
        now = now_tick()
        with self._lock:
            created = self.counters.rows_created
            slots = self._resolve(keys, now, create=create, sighting=True)
            if self._every_push and self.counters.rows_created != created:
                try:
                    self.counters.rows_written += self._need_disk().write_created(self._ram, keys, slots)
                except StorageFailed as exc:
                    self.counters.rows_created = created
                    self._on_write_failure(str(exc))
            self._ram.gather(slots, out, now, touch)
            if create or initial or self.spec.serving_default == "initial":
                absent = np.flatnonzero(slots < 0)  # read as their initial rows, not stored
                if absent.size:
                    self._ram.fill_initial(keys[absent], out, absent)
                    self.counters.lookups_not_admitted += int(absent.size) if create else 0
            self.counters.lookups += keys.shape[0]
        return out

    def push(
        self,
        keys: npt.ArrayLike,
        grads: npt.ArrayLike,
        *,
        client_id: str = "",
        seq: int = 0,
        check: bool = True,
        origins: KeyOrigins | None = None,
    ) -> int | None:
        """Apply ``grads[i]`` to the row of ``keys[i]`` with the table's optimizer.

        Gradients of duplicate keys are summed first; missing keys get their initial
        row before the update (keys not admitted yet are dropped and counted). Raises
        ``InvalidRequest`` (nothing applied) for a wrong shape or a NaN/Inf value;
        ``check=False`` skips that scan for a caller that already ran
        ``validate_grads`` on these arrays. ``StorageFailed`` (every-push mode): nothing
        applied. Returns the number of distinct rows updated, or None when this
        ``(client_id, seq)`` was applied before (``seq == 0``: never deduplicated).
        ``origins``: where the keys were before the last reshard that brought this shard
        keys; the push is applied once per key against the ledger that came with them
        (``TableLedgers``), each ledger's part as one push.
        """
        k = as_keys(keys, self._keys_field)
        g = np.ascontiguousarray(grads, dtype=np.float32)
        if check:
            self.validate_grads(k, g)
        now = now_tick()
        with self._lock:
            record = self.ledgers.record_for(client_id, seq, k.shape[0], origins)
            if record is None:
                return None
            if record.fresh is not None:
                k, g = k[record.fresh], g[record.fresh]
            return self._push_locked(k, g, client_id, seq, record, now)

    def _push_locked(
        self,
        k: npt.NDArray[np.int64],
        g: npt.NDArray[np.float32],
        client_id: str,
        seq: int,
        record: PushRecord,
        now: np.uint32,
    ) -> int | None:
        """``push`` recorded as ``record`` says. Caller holds the lock."""
        with record.ledger.claim(client_id, seq) as fresh:
            # The claim is recorded when this block ends, still under the table lock: a
            # write of this table never sees rows with a push its ledger lacks.
            if not fresh:
                return None
            slots = self._resolve(k, now, create=True, sighting=False)
            kept = slots >= 0
            if not kept.all():
                self.counters.pushes_dropped += int(k.shape[0] - kept.sum())
                k, g, slots = k[kept], g[kept], slots[kept]
            slots, k, g = self._ram.merge_duplicates(slots, k, g)
            if self.health is not None:
                sample = self.health.sample(slots)
                before = self._ram.values_float32(sample)
            if self._every_push:
                entry = (record.name, record.ledger.encode_after(client_id, seq))
                self.counters.rows_written += self._need_disk().push_durably(
                    self._ram, k, g, slots, now, entry if seq else None
                )
            else:
                self._ram.apply(k, slots, g, now)
            if self.health is not None:
                self.health.pushed(before, self._ram.values_float32(sample))
            self.counters.pushes += slots.shape[0]
            return int(slots.shape[0])

    def validate_grads(self, keys: npt.NDArray[np.int64], grads: npt.NDArray[np.float32]) -> None:
        """Raise ``InvalidRequest`` unless ``grads`` is ``[len(keys), dim]`` and all finite."""
        check_grads(f"table {self.spec.name!r}", keys, grads, self.dim)

    def _resolve(
        self, keys: npt.NDArray[np.int64], now: np.uint32, *, create: bool, sighting: bool
    ) -> npt.NDArray[np.int32]:
        """Slots of ``keys``: RAM first, then disk (faulted in), then new rows if ``create``
        and admitted. -1 where a key has no row. Caller holds the lock."""
        ram = self._ram
        slots = ram.slots(keys)
        miss = slots < 0
        n_miss = int(np.count_nonzero(miss))
        if sighting:  # the hit rate counts lookups: a push's rows were just looked up
            self.counters.ram_hits += keys.shape[0] - n_miss
        if n_miss == 0:
            return slots
        # Unique, in RocksDB's key order (uint64): sorted multi-gets are cheaper.
        missing = np.unique(keys[miss].view(np.uint64)).view(np.int64)
        if self._disk is not None:
            found, stored = self._disk.read(missing)
            faulted = len(stored)
            if faulted:
                ram.install(dataclasses.replace(stored, last_access=np.full(faulted, now, np.uint32)), dirty=CLEAN)
                self.counters.rows_faulted_in += faulted
                self.spilled = max(0, self.spilled - faulted)
                if sighting:  # each looked-up occurrence of a key found on disk is a miss
                    on_disk = (
                        n_miss if faulted == missing.shape[0] else int(np.count_nonzero(ram.slots(keys[miss]) >= 0))
                    )
                    self.counters.ram_misses += on_disk
            missing = missing[~found]
        if create and missing.size:
            if not ram.admits_all:
                missing = missing[ram.admit(missing, sighting)]
            self.counters.rows_created += ram.create(missing, now)
        slots[miss] = ram.slots(keys[miss])
        return slots

    # -- whole-table operations ----------------------------------------------------------

    def remove(self, keys: npt.ArrayLike) -> int:
        """Drop the rows of ``keys`` from RAM and disk (absent keys are ignored); returns
        how many were resident. Waits for a spill of the table under way: its copies,
        written with the table lock released, would bring a removed row back to disk."""
        k = as_keys(keys, self._keys_field)
        with self._spill_lock, self._lock:
            self._delete_stored(k)
            return int((self._ram.remove(k) >= 0).sum())

    def export(self) -> Rows:
        """Copies of every stored row, in RAM or on disk, in no particular order."""
        with self._lock:
            keys, slots = self._ram.items()
            parts = [self._ram.arena.rows(keys, slots)]
            if self._disk is not None:
                parts += [stored[self._ram.slots(stored.keys) < 0] for stored in self._disk.scan()]
        return Rows.concat(parts, self._ram.format)

    def peek_rows(self, keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.bool_], Rows]:
        """Which of the distinct, sorted ``keys`` have a row, and those rows whole, from
        RAM or disk, as copies: nothing is created, counted, faulted in or touched (the
        change stream and reshards read so)."""
        with self._lock:
            slots = self._ram.slots(keys)
            found = slots >= 0
            resident = self._ram.arena.rows(keys[found], slots[found])  # in the keys' order
            if self._disk is None or found.all():
                return found, resident
            cold = np.flatnonzero(~found)
            on_disk, stored = self._disk.read(keys[cold])
            found[cold[on_disk]] = True
        rows = Rows.concat([resident, stored], self._ram.format)
        return found, rows[np.argsort(rows.keys.view(np.uint64), kind="stable")]

    def install_rows(self, rows: Rows) -> None:
        """Make ``rows`` (distinct keys) the rows of their keys, whole: values, optimizer
        state and lifecycle metadata, as a reshard moves them here. With a data dir they
        are written there first (in batches, the table lock released between them), so
        they are durable once this returns. ``StorageFailed``: some may not be."""
        disk = self._disk
        step = SPILL_CHUNK if disk is not None else max(1, len(rows))
        for start in range(0, len(rows), step):
            part = rows[start : start + step]
            with self._lock:
                if disk is not None:
                    with disk.write_lock:
                        disk.commit_push(part, None)
                self._ram.install(part, dirty=CLEAN if disk is not None else DIRTY)

    def remove_where(self, select: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.bool_]]) -> npt.NDArray[np.int64]:
        """Drop every row, in RAM or on disk, whose key ``select(keys)`` marks; returns
        their keys. Runs a chunk at a time: a row created meanwhile is looked at if it is
        on disk by the time the scan gets there (a reshard stops such creation first)."""
        with self._lock:
            keys, _ = self._ram.items()
        picked = keys[select(keys)] if keys.size else keys
        gone = [picked]
        if picked.size:
            self.remove(picked)
        if self._disk is not None:
            for stored in self._disk.scan():
                picked = stored.keys[select(stored.keys)]
                if picked.size:
                    with self._lock:
                        self._delete_stored(picked)
                        on_disk_only = self._ram.remove(picked) < 0
                        self.spilled = max(0, self.spilled - int(on_disk_only.sum()))
                    gone.append(picked)
        return np.unique(np.concatenate(gone).view(np.uint64)).view(np.int64)

    def settle_ledgers(self, now: float, settle_s: float) -> bool:
        """Merge the push ledgers a reshard kept apart, once they may be (see
        ``TableLedgers.collapse``); True when none are kept apart."""
        with self._lock:
            return self.ledgers.collapse(now, settle_s)

    def resident_keys(self) -> npt.NDArray[np.int64]:
        """The keys of the rows in RAM (a copy)."""
        with self._lock:
            return self._ram.items()[0].copy()

    def scan(self, chunk_rows: int = SPILL_CHUNK) -> Iterator[Rows]:
        """Every row of the table whole, up to ``chunk_rows`` at a time: those in RAM when
        the scan starts (each chunk read under the lock, as it is then), then those only on
        disk, as stored (read without the lock). Copies; nothing is created, counted or
        faulted in."""
        resident = self._sorted_resident_keys()
        for start in range(0, resident.shape[0], chunk_rows):
            yield self.peek_rows(resident[start : start + chunk_rows])[1]
        yield from self._disk_only(resident)

    def stored_keys(self) -> Iterator[npt.NDArray[np.int64]]:
        """The key of every row, without reading the rows in RAM: those in RAM when the scan
        starts (one sorted array), then, a chunk at a time, those only on disk (read without
        the lock). A caller reads the rows it wants with ``peek_rows``, as they are then."""
        resident = self._sorted_resident_keys()
        yield resident
        for stored in self._disk_only(resident):
            yield stored.keys

    def _sorted_resident_keys(self) -> npt.NDArray[np.int64]:
        return np.sort(self.resident_keys().view(np.uint64)).view(np.int64)

    def _disk_only(self, resident: npt.NDArray[np.int64]) -> Iterator[Rows]:
        """The rows on disk whose keys are not among the sorted ``resident`` keys, as stored."""
        disk = self._disk
        if disk is None or not (self.spilled or disk.estimated):
            return  # every row is in RAM (none was spilled, none came back from disk since a start)
        order = resident.view(np.uint64)
        for stored in disk.scan():
            if order.size and len(stored):  # rows in RAM when the scan began are not read again
                at = np.minimum(np.searchsorted(order, stored.keys.view(np.uint64)), order.shape[0] - 1)
                stored = stored[order[at] != stored.keys.view(np.uint64)]
            if len(stored):
                yield stored

    def admission_counters(self) -> bytes | None:
        """The admission sketch's counters (None: the table admits every key at once), which
        a reshard sends with the keys that move."""
        with self._lock:
            return self._ram.admission.counters() if self._ram.admission is not None else None

    def merge_admission(self, counters: bytes) -> None:
        """Take another shard's admission ``counters`` of this table (``Admission.merge``);
        a table that admits every key at once keeps none."""
        with self._lock:
            if self._ram.admission is not None:
                self._ram.admission.merge(counters)

    def assign(self, keys: npt.NDArray[np.int64], values: npt.NDArray[Any]) -> None:
        """Set the rows of the distinct ``keys`` to ``values`` (float32 or stored elements,
        creating them), optimizer state untouched: how a serving shard applies its
        training shard's changes."""
        with self._lock:
            slots = self._resolve(keys, now_tick(), create=True, sighting=False)
            self._ram.put_values(slots, values)
            self._ram.mark(slots, DIRTY)

    def write_to(self, rows: TableRows, storage: Storage) -> int:
        """Write every resident row and the ledger into another data directory (a
        checkpoint of a shard without one); returns rows written."""
        with self._lock:
            keys, slots = self._ram.items()
            ledger = self.ledgers.entries()
            return sum(s.shape[0] for s in write_rows(self._ram, keys, slots, ledger, rows, storage))

    def eviction_scan(self, now: np.uint32, policy: Eviction = "lfu") -> EvictionScan:
        """Resident rows ranked for eviction (``ps.table.lifecycle``), outside the table lock."""
        with self._lock:
            _, slots, last_access, frequency = self._ram.eviction_columns()
        return scan_ranks(slots, last_access, frequency, now, policy)

    def scan_health(self, window_s: float) -> ScanResult | None:
        """Scan the resident rows for ``health`` (outside the table lock); None without health."""
        if self.health is None:
            return None
        now, unix_s = now_tick(), time.time()
        with self._lock:
            _, slots, last_access, _ = self._ram.eviction_columns()
        return self.health.scan(slots, last_access, now, unix_s, window_s)

    def unpersisted_rows(self) -> int:
        """Resident rows not on disk as they are in RAM."""
        with self._lock:
            return self._ram.dirty_count()

    @contextlib.contextmanager
    def held(self) -> Iterator[HeldTable]:
        """Hold the table (its lock, then its disk's write lock) for the block: no lookup,
        push, spill, flush or expiry of it runs meanwhile, and nothing writes its rows.
        A caller holding several tables takes them in name order. Blocks until a spill
        of the table in progress has written its copies."""
        with self._lock, self._disk.write_lock if self._disk is not None else contextlib.nullcontext():
            yield HeldTable(self.spec, self._ram, self._disk, self.ledgers, self.counters, len(self) + self.spilled)

    # -- moving rows to disk -------------------------------------------------------------

    def _need_disk(self) -> DiskTier:
        if self._disk is None:
            raise RuntimeError(f"table {self.spec.name!r} has no storage to evict to (start with --data-dir)")
        return self._disk

    def evict(
        self,
        count: int,
        now: np.uint32 | None = None,
        scan: EvictionScan | None = None,
        policy: Eviction = "lfu",
    ) -> int:
        """Move up to ``count`` rows out of RAM, the first in ``policy``'s order (see
        ``ps.table.lifecycle``); returns how many left.

        Rows looked up fewer than ``lifecycle.evict_below_frequency`` times are deleted
        (from RAM and disk); the rest are written to disk if dirty, then dropped from
        RAM; rows used while they were being written stay. ``scan``: this table's
        ``eviction_scan(now, policy)``, if the caller has it. Needs storage. ``StorageFailed``:
        nothing left RAM.
        """
        disk = self._need_disk()
        now = now_tick() if now is None else now
        lifecycle = self.spec.lifecycle
        with self._spill_lock:
            with self._lock:
                columns = self._ram.eviction_columns()
            # The pass over the index runs outside the table lock (2-4 ms on 200K rows, which
            # lookups waited for); under it, victims are checked: same slot, unused since.
            keys, slots, ranks = select_victims(*columns, now, count, policy, scan)
            keys, first = np.unique(keys, return_index=True)  # a key moved mid-scan is seen twice
            slots, ranks = slots[first], ranks[first]
            with self._lock:
                keep = self._ram.unchanged_victims(keys, slots, ranks, now, policy)
                keys, slots = keys[keep], slots[keep]
                if not keys.size:
                    return 0
                floor = lifecycle.evict_below_frequency
                a = self._ram.arena
                rare = a.frequency[slots] < floor if floor else np.zeros(keys.shape[0], np.bool_)
                write = ~rare
                if not (floor or lifecycle.ttl_seconds):
                    # Lookups change only access time and count: a clean row is not rewritten
                    # for them (LFU then finds the count of its last write when it returns).
                    write &= a.dirty[slots] != CLEAN
                spill = self._begin_spill(disk, keys, slots, write, rare)
            return self._run_spill(disk, spill, evict=True)

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
        disk = self._disk
        if disk is None:
            return 0
        if metadata:
            with self.held() as table:
                return table.flush(metadata=True)
        with self._lock:
            dirty_keys, _ = self._ram.dirty_items()
        n = dirty_keys.shape[0]
        written = 0
        for start in range(0, max(n, 1), SPILL_CHUNK):  # rows dirtied since wait for the next flush
            with self._spill_lock:
                with self._lock:
                    keys = dirty_keys[start : start + SPILL_CHUNK]
                    slots = self._ram.slots(keys)
                    live = slots >= 0
                    live[live] = self._ram.arena.dirty[slots[live]] != CLEAN
                    keys, slots = keys[live], slots[live]
                    if not keys.size and not self.ledgers.has_changes():
                        continue
                    spill = self._begin_spill(
                        disk, keys, slots, np.ones(keys.shape[0], np.bool_), np.zeros(keys.shape[0], np.bool_)
                    )
                written += self._run_spill(disk, spill, evict=False)
        return written

    def _begin_spill(
        self,
        disk: DiskTier,
        keys: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int32],
        write: npt.NDArray[np.bool_],
        delete: npt.NDArray[np.bool_],
    ) -> Spill:
        """Step 1 of a spill (caller holds the spill lock and the table lock; returns
        holding the write lock too)."""
        spill = Spill.take(self._ram, keys, slots, write, delete, self.ledgers.take_changed())
        disk.write_lock.acquire()
        return spill

    def _run_spill(self, disk: DiskTier, spill: Spill, evict: bool) -> int:
        """Steps 2 and 3 (caller holds the spill lock and the write lock). Returns rows
        dropped from RAM (``evict``) or written."""
        ok = False
        try:
            disk.write_spill(spill)
            ok = True
        finally:
            disk.write_lock.release()
            with self._lock:
                done = spill.settle(self._ram, ok, evict)
                if not ok:
                    self.ledgers.mark_changed(spill.changed)
                c = self.counters
                c.rows_written += done.written
                c.rows_spilled += done.spilled
                c.rows_evicted_rare += done.deleted_rare
                self.spilled += done.spilled
        return done.spilled + done.deleted_rare if evict else done.written

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
            keys = self._ram.expired(now, ttl)
            if keys.size:
                self._delete_stored(keys)
                self._ram.remove(keys)
                removed += int(keys.size)
                self.counters.rows_expired += int(keys.size)
        if self._disk is not None:
            removed += self._expire_spilled(self._disk, now, ttl)
        return removed

    def _expire_spilled(self, disk: DiskTier, now: np.uint32, ttl: float) -> int:
        removed = 0
        for stored in disk.scan():
            old = expired_keys(stored.keys, np.arange(len(stored), dtype=np.int32), stored.last_access, now, ttl)
            if not old.size:
                continue
            with self._lock:
                # Recheck under the lock: the row may have come back to RAM, or been
                # rewritten with a newer access time, since the scan read it.
                candidates = old[self._ram.slots(old) < 0]
                found, fresh = disk.read(candidates)
                present = candidates[found]
                gone = expired_keys(present, np.arange(present.shape[0], dtype=np.int32), fresh.last_access, now, ttl)
                if gone.size:
                    self._delete_stored(gone)
                    self.spilled = max(0, self.spilled - int(gone.size))
                    self.counters.rows_expired += int(gone.size)
                    removed += int(gone.size)
        return removed

    def erase(self, keys: npt.ArrayLike) -> tuple[int, int]:
        """Delete the rows of ``keys`` for good, from RAM and from disk; returns ``(rows
        deleted from RAM, rows deleted that were only on disk)``. A key erased is new again:
        its next lookup gets its initial row. Waits for a spill of the table under way (its
        copies would bring an erased row back to disk). The push ledgers stay: a push
        applied before the erase and sent again is still a duplicate. The bytes stay in
        RocksDB's files until they are compacted (``Storage.compact``)."""
        k = np.unique(as_keys(keys, self._keys_field))
        with self._spill_lock, self._lock:
            resident, on_disk = self._held(k)
            self._delete_stored(k)
            self._ram.remove(resident)
            self.spilled = max(0, self.spilled - on_disk)
            self.counters.rows_erased += int(resident.shape[0]) + on_disk
        return int(resident.shape[0]), on_disk

    def holds(self, keys: npt.ArrayLike) -> tuple[int, int]:
        """How many of ``keys`` (distinct) have a row: ``(in RAM, only on disk)``. Touches,
        creates and faults in nothing."""
        k = np.unique(as_keys(keys, self._keys_field))
        with self._lock:
            resident, on_disk = self._held(k)
        return int(resident.shape[0]), on_disk

    def _held(self, k: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], int]:
        """The resident ones of the distinct keys ``k``, and how many others are on disk (caller holds the lock)."""
        slots = self._ram.slots(k)
        resident = k[slots >= 0]
        if self._disk is None or k.shape[0] == resident.shape[0]:
            return resident, 0
        found, _ = self._disk.read(k[slots < 0])
        return resident, int(found.sum())

    def _delete_stored(self, keys: npt.NDArray[np.int64]) -> None:
        """Delete ``keys`` from disk, if the table has one (caller holds the table lock)."""
        if self._disk is None:
            return
        with self._disk.write_lock:
            try:
                self._disk.delete(keys)
            except BaseException:
                # The rows stay; whether or not the delete reached disk, write them again
                # later, so that a clean row never lacks its copy on disk.
                self._ram.mark(self._ram.slots(keys), DIRTY)
                raise
