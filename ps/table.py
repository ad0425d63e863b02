"""One embedding table on one shard: key index + arena + optimizer + ledger, behind one lock.

``Table.lookup`` returns the rows of a batch of keys, creating missing rows (in
training mode) with their deterministic initial values; ``Table.push`` applies a
batch of gradients with the table's optimizer, at most once per ``(client_id, seq)``.
Both are batch operations compiled with numba: no Python loop or object per key.

With a ``TableRows`` (a RocksDB column family, see ``ps.storage``) the table is the
RAM tier of a larger one: ``evict`` moves the least recently used rows, values and
optimizer state, to disk; a lookup or push that misses RAM reads them back with one
multi-get before anything else happens, so a key once created is never
re-initialised. What reaches disk, and when, follows the shard's durability mode:
with ``every_push`` a push is written (rows + its ledger entry, one batch) before it
is applied in RAM; otherwise changed rows stay ``dirty`` until ``flush`` or
``evict`` writes them. Every write of the table carries its ledger entries, copied
under the same lock hold as its rows, so no row on disk reflects a push the ledger on
disk does not know about. Eviction and the interval flush write their copies with
the table lock released (``ps.tier``, which holds those methods).

The table's ``Lifecycle`` adds admission (rows only for keys seen often enough),
TTL expiry (``expire``) and deletion of rare rows instead of spilling them.

Thread-safety: every public method takes the table's lock, so a table is safe to
share between gRPC handler threads; the kernels release the GIL, so different
tables work in parallel.

Example:
    >>> from ps.config import TableSpec
    >>> t = Table(TableSpec("user", dim=4, seed=1))
    >>> rows = t.lookup(np.array([10, 11, 10]))
    >>> bool((rows[0] == rows[2]).all()), len(t)
    (True, 2)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

from ps import optimizers
from ps.arena import Arena
from ps.config import TableSpec
from ps.errors import InvalidRequest
from ps.initializers import fill_initial_rows
from ps.keyindex import KeyIndex
from ps.ledger import PushLedger
from ps.lifecycle import Admission, now_tick
from ps.storage import Storage, TableRows
from ps.tier import CLEAN, DIRTY, DiskTier

__all__ = ["Table", "TableCounters"]

_INDEX_BYTES_PER_ROW = 16  # 12-byte buckets at the index's ~0.75 load factor

_FREQ_MAX = np.uint32(0xFFFFFFFF)


@numba.njit(nogil=True, cache=True)
def _gather(
    values: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int32],
    out: npt.NDArray[np.float32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
) -> None:
    dim = values.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0:
            for j in range(dim):
                out[i, j] = 0.0
            continue
        for j in range(dim):
            out[i, j] = values[s, j]
        last_access[s] = now
        if frequency[s] != _FREQ_MAX:
            frequency[s] += np.uint32(1)


@numba.njit(nogil=True, cache=True)
def _first_non_finite(grads: npt.NDArray[np.float32]) -> int:
    bits = grads.reshape(-1).view(np.uint32)
    # NaN and +-Inf are exactly the floats whose exponent bits are all ones. An integer
    # max over the exponent field vectorises (a float reduction would not, without
    # reassociation), and the search for the culprit only runs when there is one.
    exp_max = np.uint32(0)
    for i in range(bits.shape[0]):
        exp_max = max(exp_max, bits[i] & np.uint32(0x7F800000))
    if exp_max != np.uint32(0x7F800000):
        return -1
    for i in range(bits.shape[0]):
        if bits[i] & np.uint32(0x7F800000) == np.uint32(0x7F800000):
            return i
    return -1


@numba.njit(nogil=True, cache=True)
def _has_duplicates(slots: npt.NDArray[np.int32], seen: npt.NDArray[np.uint8]) -> bool:
    found = False
    for i in range(slots.shape[0]):
        s = slots[i]
        bit = np.uint8(1 << (s & 7))
        if seen[s >> 3] & bit:
            found = True
            break
        seen[s >> 3] |= bit
    # Leave the scratch bitmap all-zero for the next batch.
    for i in range(slots.shape[0]):
        seen[slots[i] >> 3] = 0
    return found


@numba.njit(nogil=True, cache=True)
def _mark_pushed(
    slots: npt.NDArray[np.int32], last_access: npt.NDArray[np.uint32], dirty: npt.NDArray[np.uint8], now: np.uint32
) -> None:
    for i in range(slots.shape[0]):
        last_access[slots[i]] = now
        dirty[slots[i]] = 1


@dataclass
class TableCounters:
    """Running totals for ``Stats`` (keys, not requests)."""

    lookups: int = 0
    pushes: int = 0
    rows_created: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    rows_spilled: int = 0
    rows_faulted_in: int = 0
    rows_written: int = 0
    lookups_not_admitted: int = 0
    pushes_dropped: int = 0
    rows_expired: int = 0
    rows_evicted_rare: int = 0


class Table(DiskTier):
    """Rows of one table on this shard (see the module docstring for the contract).

    ``rows``/``storage``: the table's column family and the data directory it lives in
    (both or neither). ``every_push``: write each push before applying it.
    """

    def __init__(
        self,
        spec: TableSpec,
        initial_capacity: int = 1024,
        *,
        rows: TableRows | None = None,
        storage: Storage | None = None,
        every_push: bool = False,
    ) -> None:
        if (rows is None) != (storage is None):
            raise ValueError("rows and storage go together: pass both or neither")
        self.spec = spec
        self.dim = spec.dim
        self.counters = TableCounters()
        self.ledger = PushLedger()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # see ps.tier: RocksDB writes in copy order
        self._spill_lock = threading.Lock()
        self._index = KeyIndex(initial_capacity)
        self._arena = Arena(spec.dim, optimizers.state_width(spec.optimizer, spec.dim), initial_capacity)
        self._seen = np.zeros(self._arena.capacity // 8 + 1, dtype=np.uint8)
        self._rows = rows
        self._storage = storage
        self._every_push = every_push and rows is not None
        lc = spec.lifecycle
        self._admission = None if lc.admits_all else Admission(lc, spec.seed)
        self.spilled = 0
        if rows is not None:
            self.spilled = rows.estimate_rows()
            for client_id, data in rows.ledgers().items():
                self.ledger.load(client_id, data)

    def __len__(self) -> int:
        """Rows resident in RAM."""
        return len(self._index)

    @property
    def bytes_per_row(self) -> int:
        """What one resident row costs the memory budget: arena columns plus index share."""
        return self._arena.row_bytes + _INDEX_BYTES_PER_ROW

    def resident_bytes(self) -> int:
        """Resident rows times ``bytes_per_row``, plus the admission counters."""
        return len(self._index) * self.bytes_per_row + self.admission_bytes()

    def admission_bytes(self) -> int:
        return self._admission.memory_bytes() if self._admission is not None else 0

    # -- lookup and push -------------------------------------------------------------

    def lookup(
        self, keys: npt.NDArray[np.int64], out: npt.NDArray[np.float32] | None = None, create: bool = True
    ) -> npt.NDArray[np.float32]:
        """Rows of ``keys`` in order, written into ``out`` (``[len(keys), dim]`` float32) or a new array.

        With ``create`` (training), missing keys get their initial rows stored (once
        admitted; until then they read as their initial rows and nothing is stored);
        without it (serving), missing keys read as zeros and nothing is stored.
        """
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if out is None:
            out = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        elif out.shape != (keys.shape[0], self.dim) or out.dtype != np.float32 or not out.flags.c_contiguous:
            # The gather kernel does not bounds-check: a wrong buffer would corrupt memory.
            raise ValueError(f"out: {out.dtype}{list(out.shape)}, expected C-contiguous float32[{keys.shape[0]}, {self.dim}]")
        now = now_tick()
        with self._lock:
            slots = self._resolve(keys, now, create=create, sighting=True)
            a = self._arena
            _gather(a.values, slots, out, a.last_access, a.frequency, now)
            if create and self._admission is not None:
                absent = np.flatnonzero(slots < 0)
                if absent.size:
                    fill_initial_rows(self.spec.initializer, self.spec.seed, keys[absent], out, absent)
                    self.counters.lookups_not_admitted += int(absent.size)
            self.counters.lookups += keys.shape[0]
        return out

    def push(
        self,
        keys: npt.NDArray[np.int64],
        grads: npt.NDArray[np.float32],
        *,
        client_id: str = "",
        seq: int = 0,
        check: bool = True,
    ) -> int | None:
        """Apply ``grads[i]`` to the row of ``keys[i]`` with the table's optimizer.

        Gradients of duplicate keys are summed first; missing keys get their initial
        row before the update (keys not admitted yet are dropped and counted). Raises
        ``InvalidRequest`` (nothing applied) for a wrong shape or a NaN/Inf value;
        ``check=False`` skips that scan for a caller that already ran
        ``validate_grads`` on these arrays. ``StorageFailed`` (every-push mode): nothing
        applied. Returns the number of distinct rows updated, or None when this
        ``(client_id, seq)`` was applied before (``seq == 0``: never deduplicated).
        """
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if check:
            self.validate_grads(keys, grads)
        now = now_tick()
        with self._lock, self.ledger.claim(client_id, seq) as fresh:
            # The claim is recorded when this block ends, still under the table lock: a
            # write of this table never sees rows with a push its ledger lacks.
            if not fresh:
                return None
            slots = self._resolve(keys, now, create=True, sighting=False)
            kept = slots >= 0
            if not kept.all():
                self.counters.pushes_dropped += int(keys.shape[0] - kept.sum())
                keys, grads, slots = keys[kept], grads[kept], slots[kept]
            if _has_duplicates(slots, self._seen):
                unique, first, inverse = np.unique(slots, return_index=True, return_inverse=True)
                summed = np.zeros((unique.shape[0], self.dim), dtype=np.float32)
                np.add.at(summed, inverse, grads)
                slots, keys, grads = unique.astype(np.int32), keys[first], summed
            a = self._arena
            if self._every_push:
                self._push_durably(keys, grads, slots, now, client_id, seq)
            else:
                optimizers.apply(self.spec.optimizer, a.values, a.state, slots, grads)
                _mark_pushed(slots, a.last_access, a.dirty, now)
            self.counters.pushes += slots.shape[0]
            return int(slots.shape[0])

    def _push_durably(
        self,
        keys: npt.NDArray[np.int64],
        grads: npt.NDArray[np.float32],
        slots: npt.NDArray[np.int32],
        now: np.uint32,
        client_id: str,
        seq: int,
    ) -> None:
        # Update copies, write them with the ledger entry, and only then install them:
        # a failed write leaves RAM exactly as it was.
        a = self._arena
        values, state = a.values[slots], a.state[slots]
        optimizers.apply(self.spec.optimizer, values, state, np.arange(slots.shape[0], dtype=np.int32), grads)
        assert self._rows is not None and self._storage is not None
        batch = self._storage.batch()
        if seq:
            self._rows.put_ledger(batch, client_id, self.ledger.encode_after(client_id, seq))
        stamp = np.full(slots.shape[0], now, dtype=np.uint32)
        self._rows.put(batch, keys, values, state, stamp, a.frequency[slots])
        with self._write_lock:
            self._storage.commit(batch)
        self.counters.rows_written += slots.shape[0]
        a.values[slots], a.state[slots], a.last_access[slots] = values, state, stamp
        a.dirty[slots] = CLEAN

    def validate_grads(self, keys: npt.NDArray[np.int64], grads: npt.NDArray[np.float32]) -> None:
        """Raise ``InvalidRequest`` unless ``grads`` is ``[len(keys), dim]`` and all finite."""
        if grads.shape != (keys.shape[0], self.dim):
            raise InvalidRequest(
                f"table {self.spec.name!r}: grads shape {tuple(grads.shape)}, expected ({keys.shape[0]}, {self.dim})"
            )
        bad = _first_non_finite(np.ascontiguousarray(grads, dtype=np.float32))
        if bad >= 0:
            raise InvalidRequest(
                f"table {self.spec.name!r}: grads[{bad // self.dim}][{bad % self.dim}] is "
                f"{grads.reshape(-1)[bad]} (NaN/Inf gradients are rejected; nothing was applied)"
            )

    # -- the RAM tier ------------------------------------------------------------------

    def _resolve(
        self, keys: npt.NDArray[np.int64], now: np.uint32, *, create: bool, sighting: bool
    ) -> npt.NDArray[np.int32]:
        """Slots of ``keys``: RAM first, then disk (faulted in), then new rows if ``create``
        and admitted. -1 where a key has no row. Caller holds the lock."""
        slots = self._index.lookup(keys)
        miss = slots < 0
        n_miss = int(np.count_nonzero(miss))
        if sighting:  # the hit rate counts lookups: a push's rows were just looked up
            self.counters.ram_hits += keys.shape[0] - n_miss
            self.counters.ram_misses += n_miss
        if n_miss == 0:
            return slots
        # Unique, in RocksDB's key order (uint64): sorted multi-gets are cheaper.
        missing = np.unique(keys[miss].view(np.uint64)).view(np.int64)
        if self._rows is not None:
            found, rec = self._rows.get(missing)
            if rec.values.shape[0]:
                stamp = np.full(rec.values.shape[0], now, dtype=np.uint32)
                self._install(missing[found], rec.values, rec.state, stamp, rec.frequency, dirty=CLEAN)
                self.counters.rows_faulted_in += rec.values.shape[0]
                self.spilled = max(0, self.spilled - rec.values.shape[0])
            missing = missing[~found]
        if create and missing.size:
            if self._admission is not None:
                ok = self._admission.admit(missing) if sighting else self._admission.admitted(missing)
                missing = missing[ok]
            self._create(missing, now)
        slots[miss] = self._index.lookup(keys[miss])
        return slots

    def _install(
        self,
        keys: npt.NDArray[np.int64],
        values: npt.NDArray[np.float32],
        state: npt.NDArray[np.float32],
        last_access: npt.NDArray[np.uint32],
        frequency: npt.NDArray[np.uint32],
        dirty: int,
    ) -> npt.NDArray[np.int32]:
        """Put rows of absent ``keys`` into RAM; returns their slots. Caller holds the lock."""
        slots, _ = self._index.lookup_or_insert(keys)
        a = self._grown_arena()
        a.values[slots], a.state[slots] = values, state
        a.last_access[slots], a.frequency[slots] = last_access, frequency
        a.dirty[slots] = dirty
        return slots

    def _grown_arena(self) -> Arena:
        """The arena, grown to cover every slot the index handed out. Caller holds the lock."""
        a = self._arena
        if self._index.slot_capacity > a.capacity:
            a.ensure_capacity(self._index.slot_capacity)
            self._seen = np.zeros(a.capacity // 8 + 1, dtype=np.uint8)
        return a

    def _create(self, keys: npt.NDArray[np.int64], now: np.uint32) -> None:
        """Store initial rows for absent ``keys``. Caller holds the lock."""
        if not keys.size:
            return
        slots, _ = self._index.lookup_or_insert(keys)
        a = self._grown_arena()
        new = slots.astype(np.int64)
        fill_initial_rows(self.spec.initializer, self.spec.seed, keys, a.values, new)
        optimizers.init_state(self.spec.optimizer, a.state, new)
        a.frequency[new] = 0
        a.last_access[new] = now
        a.dirty[new] = DIRTY
        self.counters.rows_created += new.shape[0]

    # -- whole-table operations ----------------------------------------------------------

    def remove(self, keys: npt.NDArray[np.int64]) -> int:
        """Drop the rows of ``keys`` from RAM and disk (absent keys are ignored); returns
        how many were resident."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        with self._lock:
            self._delete_stored(keys)
            freed = self._index.remove(keys)
            self._arena.dirty[freed[freed >= 0]] = CLEAN
            return int((freed >= 0).sum())

    def export(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Copies of every stored ``(keys, values, optimizer state)``, in RAM or on disk,
        in no particular order."""
        with self._lock:
            keys, slots = self._index.items()
            parts = [(keys, self._arena.values[slots], self._arena.state[slots])]
            if self._rows is not None:
                for k, rec in self._rows.scan():
                    cold = self._index.lookup(k) < 0
                    parts.append((k[cold], rec.values[cold], rec.state[cold]))
        return (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]),
        )

    def write_to(self, rows: TableRows, storage: Storage) -> int:
        """Write every resident row and the ledger into another data directory (a
        checkpoint of a shard without one); returns rows written."""
        with self._lock:
            keys, slots = self._index.items()
            return sum(s.shape[0] for s in self._write_rows_locked(rows, storage, slots, keys, self.ledger.clients()))

    def memory_bytes(self) -> int:
        """Bytes held by the index, the arena, admission counters and scratch space."""
        with self._lock:
            return (
                self._index.memory_bytes() + self._arena.memory_bytes() + self._seen.nbytes + self.admission_bytes()
            )
