"""The RAM half of a table: which keys are resident, their rows, and admission counters.

``RamTier`` holds a ``KeyIndex`` (key -> slot), an ``Arena`` (rows, optimizer state and
per-row metadata by slot) and, for tables with an admission rule, the ``Admission``
sketch. Its methods are the batch operations a table runs on resident rows, each a
numba kernel or a few numpy calls: no Python loop or object per key.

Every row carries a ``dirty`` flag saying how it relates to its copy on disk:
``CLEAN`` (the same), ``DIRTY`` (changed since it was written) or ``WRITING`` (a copy is
being written; a push meanwhile turns it back to ``DIRTY``). Without a disk, rows are
simply never cleaned.

Not thread-safe: the owning ``Table`` holds its lock around every call (see
``ps.table``). Arrays returned are new unless a docstring says they are views.

Example:
    >>> from ps.table.spec import TableSpec
    >>> ram = RamTier(TableSpec("t", dim=2, seed=1))
    >>> ram.create(np.array([5, 6]), now=np.uint32(0))
    2
    >>> out = np.empty((2, 2), np.float32)
    >>> ram.gather(ram.slots(np.array([6, 7])), out, now=np.uint32(1))
    >>> len(ram), bool(out[1].any())  # key 7 has no row: zeros
    (2, False)
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from ps.store import Rows, bfloat16_bits_to_float32_bits, float16_bits_to_float32_bits, precision
from ps.table import optimizers
from ps.table.arena import Arena
from ps.table.initializers import fill_initial_rows, initial_rows
from ps.table.keyindex import KeyIndex
from ps.table.lifecycle import Admission, Eviction, expired_keys, unchanged_ranks
from ps.table.prefetch import prefetch
from ps.table.spec import TableSpec

__all__ = ["CLEAN", "DIRTY", "WRITING", "RamTier"]

CLEAN, DIRTY, WRITING = 0, 1, 2  # arena.dirty: on disk as in RAM / changed since / being written

_INDEX_BYTES_PER_ROW = 16  # 12-byte buckets at the index's ~0.75 load factor
_FREQ_MAX = np.uint32(0xFFFFFFFF)


# Rows fetched ahead in a gather: rows sit at random slots, so no hardware prefetcher
# sees them coming. The first line of a row is asked for (the core fetches the rest once
# it is touched), and the row's last_access and frequency words, two more misses per row
# (65,536 rows of 256 B from a 1M-row arena: 4.04 -> 3.68 ms, whole rows prefetched 3.74;
# 1,300 rows from 100K: 43.6 -> 40.9 us).
_AHEAD = 8


@numba.njit(nogil=True, cache=True)
def _gather(
    values: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int32],
    out: npt.NDArray[np.float32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    touch: bool,
) -> None:
    dim = values.shape[1]
    n = slots.shape[0]
    for i in range(n):
        if i + _AHEAD < n and slots[i + _AHEAD] >= 0:
            prefetch(values, slots[i + _AHEAD])
            if touch:
                prefetch(last_access, slots[i + _AHEAD])
                prefetch(frequency, slots[i + _AHEAD])
        s = slots[i]
        row = out[i]  # 1-D row views: the copy loop vectorizes
        if s < 0:
            for j in range(dim):
                row[j] = 0.0
            continue
        src = values[s]
        for j in range(dim):
            row[j] = src[j]
        if touch:
            last_access[s] = now
            if frequency[s] != _FREQ_MAX:
                frequency[s] += np.uint32(1)


@numba.njit(nogil=True, cache=True)
def _gather16(
    values: npt.NDArray[np.uint16],
    slots: npt.NDArray[np.int32],
    out: npt.NDArray[np.uint32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    touch: bool,
    bfloat16: bool,
) -> None:
    """``_gather`` of 16-bit rows (bits in ``values``), decoded into float32 bits in ``out``."""
    dim = values.shape[1]
    n = slots.shape[0]
    for i in range(n):
        if i + _AHEAD < n and slots[i + _AHEAD] >= 0:
            prefetch(values, slots[i + _AHEAD])
            if touch:
                prefetch(last_access, slots[i + _AHEAD])
                prefetch(frequency, slots[i + _AHEAD])
        s = slots[i]
        row = out[i]
        if s < 0:
            for j in range(dim):
                row[j] = 0
            continue
        src = values[s]
        if bfloat16:
            for j in range(dim):
                row[j] = bfloat16_bits_to_float32_bits(src[j])
        else:
            for j in range(dim):
                row[j] = float16_bits_to_float32_bits(src[j])
        if touch:
            last_access[s] = now
            if frequency[s] != _FREQ_MAX:
                frequency[s] += np.uint32(1)


@numba.njit(nogil=True, cache=True)
def _gather8(
    codes: npt.NDArray[np.uint8],
    params: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int32],
    out: npt.NDArray[np.float32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    touch: bool,
) -> None:
    """``_gather`` of 8-bit rows: ``code * scale + bias`` (``params[s]``), as ``precision.dequantize``."""
    dim = codes.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        row = out[i]
        if s < 0:
            for j in range(dim):
                row[j] = 0.0
            continue
        src = codes[s]
        scale, bias = params[s, 0], params[s, 1]
        for j in range(dim):
            row[j] = np.float32(np.float32(src[j]) * scale) + bias
        if touch:
            last_access[s] = now
            if frequency[s] != _FREQ_MAX:
                frequency[s] += np.uint32(1)


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
        dirty[slots[i]] = DIRTY


@numba.njit(nogil=True, cache=True)
def _next_versions(version: npt.NDArray[np.uint32], slots: npt.NDArray[np.int32]) -> npt.NDArray[np.uint32]:
    """Count one more update of the rows at ``slots``; their new versions."""
    out = np.empty(slots.shape[0], np.uint32)
    for i in range(slots.shape[0]):
        version[slots[i]] += np.uint32(1)
        out[i] = version[slots[i]]
    return out


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


class RamTier:
    """Resident rows of one table (see the module docstring). ``index`` and ``arena`` are
    public for the table's disk half and for inspection; both follow the same contract."""

    def __init__(self, spec: TableSpec, initial_capacity: int = 1024) -> None:
        self.spec = spec
        self.index = KeyIndex(initial_capacity)
        self.format = spec.row_format
        self.arena = Arena(self.format, initial_capacity)
        self.rounding = precision.Rounding()  # elements clamped or flushed to zero on the way to 16 bits
        lc = spec.lifecycle
        self._admission = None if lc.admits_all else Admission(lc, spec.seed)
        self._seen = np.zeros(self.arena.capacity // 8 + 1, dtype=np.uint8)  # scratch for duplicate checks

    def __len__(self) -> int:
        return len(self.index)

    # -- sizes ---------------------------------------------------------------------------

    @property
    def bytes_per_row(self) -> int:
        """What one resident row costs the memory budget: arena columns plus index share."""
        return self.arena.row_bytes + _INDEX_BYTES_PER_ROW

    def admission_bytes(self) -> int:
        return self._admission.memory_bytes() if self._admission is not None else 0

    def resident_bytes(self) -> int:
        """Resident rows times ``bytes_per_row``, plus the admission counters."""
        return len(self.index) * self.bytes_per_row + self.admission_bytes()

    def memory_bytes(self) -> int:
        """Bytes held by the index, the arena, admission counters and scratch space."""
        return self.index.memory_bytes() + self.arena.memory_bytes() + self._seen.nbytes + self.admission_bytes()

    # -- reading and creating rows -------------------------------------------------------

    def slots(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """Slot of each key, -1 where it has no resident row."""
        return self.index.lookup(keys)

    def gather(self, slots: npt.NDArray[np.int32], out: npt.NDArray[Any], now: np.uint32, touch: bool = True) -> None:
        """Copy the rows at ``slots`` into ``out`` (zeros where a slot is -1), marking them
        used at ``now`` unless ``touch`` is False (their last use and use count stay as
        they were). ``out`` must be C-contiguous ``[len(slots), dim]``, float32 or the stored
        type (rows copied as stored): the kernel does not bounds-check."""
        a = self.arena
        kind = self.format.values
        if kind == precision.FLOAT32:
            _gather(a.values, slots, out, a.last_access, a.frequency, now, touch)
        elif kind == precision.INT8:
            _gather8(a.values, a.state, slots, out, a.last_access, a.frequency, now, touch)
        elif out.dtype == a.values.dtype:  # as stored: the bits copied (numba has no float16)
            _gather(a.values.view(np.uint16), slots, out.view(np.uint16), a.last_access, a.frequency, now, touch)
        else:
            bits = a.values.view(np.uint16)
            _gather16(
                bits, slots, out.view(np.uint32), a.last_access, a.frequency, now, touch, kind == precision.BFLOAT16
            )

    def fill_initial(self, keys: npt.NDArray[np.int64], out: npt.NDArray[Any], at: npt.NDArray[np.integer]) -> None:
        """Write the initial rows of ``keys`` into ``out[at]`` (float32, or the stored type)
        as they read once stored: rounded to the nearest value of the storage type."""
        kind = self.format.values
        if kind == precision.INT8:
            out[at] = precision.dequantize(
                *precision.quantize(initial_rows(self.spec.initializer, self.spec.seed, keys, self.spec.dim))
            )
            return
        if out.dtype != np.float32:  # the stored type
            rows = initial_rows(self.spec.initializer, self.spec.seed, keys, self.spec.dim)
            out[at] = precision.encode_nearest(kind, rows)
            return
        fill_initial_rows(self.spec.initializer, self.spec.seed, keys, out, at)
        if kind != precision.FLOAT32:
            out[at] = precision.decode(kind, precision.encode_nearest(kind, out[at]))

    def values_float32(self, slots: npt.NDArray[np.int32]) -> npt.NDArray[np.float32]:
        """Copies of the values at ``slots``, as float32."""
        return precision.gather_float32(self.format.values, self.arena.values, slots)

    def put_values(self, slots: npt.NDArray[np.int32], values: npt.NDArray[Any]) -> None:
        """Set the values of the rows at ``slots`` (float32, or 16-bit elements as they travel:
        ``precision.widen``), converted to the stored type: 16-bit to nearest, 8-bit quantized."""
        a, kind = self.arena, self.format.values
        if kind == precision.INT8:
            a.values[slots], a.state[slots] = precision.quantize(precision.widen(values))
        elif values.dtype == a.values.dtype:
            a.values[slots] = values
        else:
            a.values[slots] = precision.encode_nearest(kind, precision.widen(values), self.rounding)

    @property
    def out_dtypes(self) -> tuple[np.dtype[Any], ...]:
        """What ``gather`` may write: float32, and a 16-bit table's own elements."""
        kind = self.format.values
        return (
            np.dtype(np.float32),
            *((self.arena.values.dtype,) if kind in (precision.BFLOAT16, precision.FLOAT16) else ()),
        )

    @property
    def admits_all(self) -> bool:
        """True when every key gets a row on first sight."""
        return self._admission is None

    @property
    def admission(self) -> Admission | None:
        """The admission sketch (None when every key is admitted)."""
        return self._admission

    def admit(self, keys: npt.NDArray[np.int64], sighting: bool) -> npt.NDArray[np.bool_]:
        """Which of ``keys`` (distinct, without rows) may get a row now; a ``sighting`` (a
        lookup) counts towards admission, a push only asks."""
        if self._admission is None:
            return np.ones(keys.shape[0], np.bool_)
        return self._admission.admit(keys) if sighting else self._admission.admitted(keys)

    def create(self, keys: npt.NDArray[np.int64], now: np.uint32) -> int:
        """Store the initial rows of absent, distinct ``keys`` (``DIRTY``); returns how many."""
        if not keys.size:
            return 0
        slots, _ = self.index.lookup_or_insert(keys)
        a = self._grown_arena()
        new = slots.astype(np.int64)
        fmt, spec = self.format, self.spec
        if fmt.values == precision.INT8:  # a serving table: a scale and a bias in place of state
            a.values[new], a.state[new] = precision.quantize(initial_rows(spec.initializer, spec.seed, keys, spec.dim))
        elif fmt.values == precision.FLOAT32 and fmt.state == precision.FLOAT32:
            fill_initial_rows(spec.initializer, spec.seed, keys, a.values, new)
            optimizers.init_state(spec.optimizer, a.state, new)
        else:  # computed in float32, rounded to nearest
            a.values[new] = precision.encode_nearest(
                fmt.values, initial_rows(spec.initializer, spec.seed, keys, spec.dim), self.rounding
            )
            state = np.empty((new.shape[0], fmt.state_width), np.float32)
            optimizers.init_state(spec.optimizer, state, np.arange(new.shape[0]))
            a.state[new] = precision.encode_nearest(fmt.state, state, self.rounding)
        if fmt.versioned:
            a.version[new] = 0
        a.frequency[new] = 0
        a.last_access[new] = now
        a.dirty[new] = DIRTY
        return int(new.shape[0])

    def install(self, rows: Rows, dirty: int) -> npt.NDArray[np.int32]:
        """Put given rows of absent keys into RAM (rows read back from disk); returns their slots."""
        slots, _ = self.index.lookup_or_insert(rows.keys)
        a = self._grown_arena()
        a.values[slots], a.state[slots] = rows.values, rows.state
        a.last_access[slots], a.frequency[slots] = rows.last_access, rows.frequency
        if self.format.versioned:
            a.version[slots] = rows.version
        a.dirty[slots] = dirty
        return slots

    def _grown_arena(self) -> Arena:
        """The arena, grown to cover every slot the index handed out."""
        a = self.arena
        if self.index.slot_capacity > a.capacity:
            a.ensure_capacity(self.index.slot_capacity)
            self._seen = np.zeros(a.capacity // 8 + 1, dtype=np.uint8)
        return a

    # -- updating rows -------------------------------------------------------------------

    def merge_duplicates(
        self, slots: npt.NDArray[np.int32], keys: npt.NDArray[np.int64], grads: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """``(slots, keys, grads)`` with each slot once, its gradients summed (``np.add.at``
        into zeros, in input order); the inputs themselves when there are no duplicates."""
        if not _has_duplicates(slots, self._seen):
            return slots, keys, grads
        unique, first, inverse = np.unique(slots, return_index=True, return_inverse=True)
        summed = np.zeros((unique.shape[0], self.spec.dim), dtype=np.float32)
        np.add.at(summed, inverse, grads)
        return unique.astype(np.int32), keys[first], summed

    def apply(
        self, keys: npt.NDArray[np.int64], slots: npt.NDArray[np.int32], grads: npt.NDArray[np.float32], now: np.uint32
    ) -> None:
        """Apply the table's optimizer to the distinct rows of ``keys`` at ``slots``; they become ``DIRTY``."""
        a, fmt = self.arena, self.format
        if fmt.versioned:  # computed in float32, rounded back into place (ps.store.precision)
            values = precision.gather_float32(fmt.values, a.values, slots)
            state = precision.gather_float32(fmt.state, a.state, slots)
            optimizers.apply(self.spec.optimizer, values, state, np.arange(slots.shape[0], dtype=np.int32), grads)
            self._round(keys, _next_versions(a.version, slots), values, state, a.values, a.state, slots)
        else:
            optimizers.apply(self.spec.optimizer, a.values, a.state, slots, grads)
        _mark_pushed(slots, a.last_access, a.dirty, now)

    def _round(
        self,
        keys: npt.NDArray[np.int64],
        versions: npt.NDArray[np.uint32],
        values: npt.NDArray[np.float32],
        state: npt.NDArray[np.float32],
        values_out: npt.NDArray[Any],
        state_out: npt.NDArray[Any],
        at: npt.NDArray[np.integer[Any]] | None = None,
    ) -> None:
        """Round updated float32 ``values`` and ``state`` into the stored arrays (at rows ``at``)."""
        fmt, seed, counts = self.format, self.spec.seed, self.rounding
        precision.round_into(fmt.values, values, values_out, keys, versions, seed=seed, first=0, counts=counts, at=at)
        precision.round_into(
            fmt.state, state, state_out, keys, versions, seed=seed, first=fmt.dim, counts=counts, at=at
        )

    def updated_rows(
        self, keys: npt.NDArray[np.int64], slots: npt.NDArray[np.int32], grads: npt.NDArray[np.float32], now: np.uint32
    ) -> Rows:
        """The rows of ``keys`` at ``slots`` as the optimizer would leave them, pushed at
        ``now``, as new arrays: RAM is unchanged (a write-ahead caller installs them with
        ``store``)."""
        rows = self.arena.rows(keys, slots)
        at = np.arange(slots.shape[0], dtype=np.int32)
        fmt = self.format
        if not fmt.versioned:
            optimizers.apply(self.spec.optimizer, rows.values, rows.state, at, grads)
            rows.last_access[:] = now
            return rows
        # Computed in float32, rounded back stochastically (ps.store.precision).
        values = precision.decode(fmt.values, rows.values)
        state = precision.decode(fmt.state, rows.state)
        optimizers.apply(self.spec.optimizer, values, state, at, grads)
        rows.version[:] += np.uint32(1)
        self._round(keys, rows.version, values, state, rows.values, rows.state)
        rows.last_access[:] = now
        return rows

    def store(self, slots: npt.NDArray[np.int32], rows: Rows) -> None:
        """Overwrite the rows at ``slots`` with ``rows``' values, state and last use, copies
        already written to disk (``CLEAN``)."""
        a = self.arena
        a.values[slots], a.state[slots], a.last_access[slots] = rows.values, rows.state, rows.last_access
        if self.format.versioned:
            a.version[slots] = rows.version
        a.dirty[slots] = CLEAN

    def mark(self, slots: npt.NDArray[np.int32], flag: int) -> None:
        """Set the dirty flag of the rows at ``slots`` (slots < 0 are skipped)."""
        self.arena.dirty[slots[slots >= 0]] = flag

    def remove(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """Drop the rows of ``keys`` from RAM; returns the slot each freed (-1: absent)."""
        freed = self.index.remove(keys)
        self.arena.dirty[freed[freed >= 0]] = CLEAN
        return freed

    # -- scans over every resident row ---------------------------------------------------

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """Every resident ``(keys, slots)``."""
        return self.index.items()

    def dirty_items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """``(keys, slots)`` of every resident row that is not ``CLEAN``."""
        keys = np.empty(len(self.index), np.int64)
        slots = np.empty(len(self.index), np.int32)
        n = _collect_dirty(*self.index.buckets(), self.arena.dirty, keys, slots)
        return keys[:n], slots[:n]

    def dirty_count(self) -> int:
        """How many resident rows are not ``CLEAN``."""
        empty_k, empty_s = np.empty(0, np.int64), np.empty(0, np.int32)
        return int(_collect_dirty(*self.index.buckets(), self.arena.dirty, empty_k, empty_s))

    def eviction_columns(
        self,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
        """The arrays the eviction passes read, as ``(index keys, index slots, last_access,
        frequency)``: taken under the table lock and scanned outside it (see ``Table.evict``),
        they stay valid memory if the index or the arena grows meanwhile."""
        a = self.arena
        return (*self.index.buckets(), a.last_access, a.frequency)

    def unchanged_victims(
        self,
        keys: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int32],
        ranks: npt.NDArray[np.int64],
        now: np.uint32,
        policy: Eviction,
    ) -> npt.NDArray[np.bool_]:
        """Which of the victims ``(keys, slots, ranks)`` from ``select_victims`` over a
        snapshot of ``eviction_columns`` are still resident at the same slot and unused since."""
        same: npt.NDArray[np.bool_] = self.index.lookup(keys) == slots
        a = self.arena
        return same & unchanged_ranks(np.where(same, slots, -1), ranks, a.last_access, a.frequency, now, policy)

    def expired(self, now: np.uint32, ttl_seconds: float) -> npt.NDArray[np.int64]:
        """Keys of resident rows idle for longer than ``ttl_seconds``."""
        return expired_keys(*self.index.buckets(), self.arena.last_access, now, ttl_seconds)
