"""int64 key -> int32 slot map for one embedding table.

`KeyIndex` is an open-addressing hash table (linear probing, backward-shift deletion) stored in
two flat numpy arrays, with every batch operation compiled by numba.  It also hands out slots,
so the arena that stores rows by slot never sees two live keys on one slot.

Memory: 12 bytes per bucket (int64 key + int32 slot) at a load factor between 0.375 and 0.75,
plus 4 bytes per freed-but-unused slot; about 20 bytes per live key at 10M keys.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from protos.hashing import mix64_step
from protos.wire import as_keys
from ps.table.prefetch import prefetch

__all__ = ["KeyIndex", "MAX_SLOTS"]

MAX_SLOTS = 2**31 - 1
"""Slots are int32 and -1 means "empty", so at most this many slots (0 .. 2**31 - 2) exist."""

# splitmix64's finalizer, but keyed with a XOR first: shards are chosen from plain mix64(key),
# so every key on one shard shares structure in mix64's bits; a differently keyed mixer keeps
# that structure out of the bucket position.
_SEED = np.uint64(0x9E3779B97F4A7C15)

# Kernel status codes, returned to Python so that raising and growing stay out of numba.
_DONE, _NEED_GROW, _OUT_OF_SLOTS = 0, 1, 2


@numba.njit(nogil=True, cache=True, inline="always")
def _home(key: np.int64, mask: int) -> np.int64:
    return np.int64(mix64_step(np.uint64(key) ^ _SEED) & np.uint64(mask))


# Keys probed ahead: a probe of a large index misses cache, and prefetching the home
# slots this far ahead overlaps those misses (1,300 probes of a 2M-slot index: 29 -> 16 us).
_AHEAD = 16


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch_home(tkeys: npt.NDArray[np.int64], tslots: npt.NDArray[np.int32], key: np.int64, mask: int) -> None:
    pos = _home(key, mask)
    prefetch(tkeys, pos)
    prefetch(tslots, pos)


@numba.njit(nogil=True, cache=True)
def _lookup_batch(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    keys: npt.NDArray[np.int64],
    out: npt.NDArray[np.int32],
) -> None:
    mask = tkeys.size - 1
    n = keys.size
    for i in range(min(_AHEAD, n)):
        _prefetch_home(tkeys, tslots, keys[i], mask)
    for i in range(n):
        if i + _AHEAD < n:
            _prefetch_home(tkeys, tslots, keys[i + _AHEAD], mask)
        key = keys[i]
        pos = _home(key, mask)
        while True:
            s = tslots[pos]
            # Reading both arrays before branching lets the two cache misses overlap.
            if s < 0 or tkeys[pos] == key:
                break
            pos = (pos + 1) & mask
        out[i] = s


@numba.njit(nogil=True, cache=True)
def _insert_batch(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    keys: npt.NDArray[np.int64],
    start: int,
    out: npt.NDArray[np.int32],
    created: npt.NDArray[np.bool_],
    free: npt.NDArray[np.int32],
    n_free: int,
    high_water: int,
    size: int,
    max_size: int,
    max_slots: int,
) -> tuple[int, int, int, int, int]:
    """Returns (stop, n_free, high_water, size, status); keys[stop:] are still to do."""
    mask = tkeys.size - 1
    for i in range(start, keys.size):
        key = keys[i]
        pos = _home(key, mask)
        while True:
            s = tslots[pos]
            if s < 0 or tkeys[pos] == key:
                break
            pos = (pos + 1) & mask
        if s >= 0:
            out[i] = s
            created[i] = False
            continue
        # Stopping here (rather than growing ahead of the batch by its length) grows the table
        # only when a genuinely new key needs room.
        if size >= max_size:
            return i, n_free, high_water, size, _NEED_GROW
        if n_free > 0:
            n_free -= 1
            s = free[n_free]
        elif high_water < max_slots:
            s = high_water
            high_water += 1
        else:
            return i, n_free, high_water, size, _OUT_OF_SLOTS
        tkeys[pos] = key
        tslots[pos] = s
        size += 1
        out[i] = s
        created[i] = True
    return keys.size, n_free, high_water, size, _DONE


@numba.njit(nogil=True, cache=True)
def _remove_batch(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    keys: npt.NDArray[np.int64],
    out: npt.NDArray[np.int32],
    free: npt.NDArray[np.int32],
    n_free: int,
    size: int,
) -> tuple[int, int]:
    """Returns (n_free, size). `free` must have room for every key that is present."""
    mask = tkeys.size - 1
    for i in range(keys.size):
        key = keys[i]
        hole = _home(key, mask)
        while True:
            s = tslots[hole]
            if s < 0 or tkeys[hole] == key:
                break
            hole = (hole + 1) & mask
        out[i] = s
        if s < 0:
            continue
        free[n_free] = s
        n_free += 1
        size -= 1
        # Backward shift: pull later entries of the probe run into the hole unless that would
        # move one before its home bucket, so no tombstones are needed and probes stay short.
        j = hole
        while True:
            j = (j + 1) & mask
            if tslots[j] < 0:
                break
            home = _home(tkeys[j], mask)
            if (j > hole and hole < home <= j) or (j < hole and (home > hole or home <= j)):
                continue  # home lies cyclically in (hole, j]: the entry must stay after it
            tkeys[hole] = tkeys[j]
            tslots[hole] = tslots[j]
            hole = j
        tslots[hole] = -1
    return n_free, size


@numba.njit(nogil=True, cache=True)
def _rehash(
    old_keys: npt.NDArray[np.int64],
    old_slots: npt.NDArray[np.int32],
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
) -> None:
    mask = tkeys.size - 1
    for i in range(old_slots.size):
        s = old_slots[i]
        if s < 0:
            continue
        pos = _home(old_keys[i], mask)
        while tslots[pos] >= 0:
            pos = (pos + 1) & mask
        tkeys[pos] = old_keys[i]
        tslots[pos] = s


@numba.njit(nogil=True, cache=True)
def _collect(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    out_keys: npt.NDArray[np.int64],
    out_slots: npt.NDArray[np.int32],
) -> None:
    n = 0
    for i in range(tslots.size):
        if tslots[i] >= 0:
            out_keys[n] = tkeys[i]
            out_slots[n] = tslots[i]
            n += 1


class KeyIndex:
    """Map int64 keys to dense int32 slots, and own which slots are in use.

    Every int64 value is a valid key.  A new key gets a slot released by `remove` if there is
    one (the most recently released first), otherwise the next never-used slot, so live slots
    are unique and always below `slot_capacity`.  The table doubles when an insert would push
    its load factor above 0.75 and never shrinks.

    Contract:
        * Not thread-safe: the caller (the table) serialises all calls with its lock.  The
          kernels release the GIL, so indexes of other tables can work in parallel meanwhile.
        * Calls block for the whole batch and keep no reference to the keys; every returned
          array is new and owned by the caller.
        * Batch methods raise `protos.wire.InvalidKeys` (a `ValueError`, and a `TypeError`)
          for keys that are not a 1-D array of integers; contiguous int64 keys are used as
          they are, without a copy.  `lookup_or_insert` raises `OverflowError`, leaving every
          key->slot mapping as it was, when the batch needs more than `MAX_SLOTS` slots.

    >>> index = KeyIndex(initial_capacity=8)
    >>> slots, created = index.lookup_or_insert(np.array([7, -1, 7], dtype=np.int64))
    >>> slots.tolist(), created.tolist()
    ([0, 1, 0], [True, True, False])
    >>> index.remove(np.array([7, 42])).tolist()
    [0, -1]
    >>> index.lookup(np.array([7, -1])).tolist()
    [-1, 1]
    >>> index.lookup_or_insert(np.array([2**63 - 1]))[0].tolist()  # slot 0 is reused
    [0]
    >>> len(index), index.slot_capacity
    (2, 2)
    """

    def __init__(self, initial_capacity: int = 1024) -> None:
        """`initial_capacity` is a number of buckets (0.75 of it fill before the first growth)."""
        if initial_capacity < 1:
            raise ValueError(f"initial_capacity must be >= 1, got {initial_capacity}")
        capacity = 1 << (int(initial_capacity) - 1).bit_length()
        self._max_slots = MAX_SLOTS  # an attribute so tests can lower it
        self._size = 0
        self._high_water = 0
        self._n_free = 0
        self._free = np.empty(0, dtype=np.int32)
        self._alloc_table(capacity)

    def _alloc_table(self, capacity: int) -> None:
        # np.zeros is calloc-backed, so untouched pages of a large key array cost nothing.
        self._keys = np.zeros(capacity, dtype=np.int64)
        self._slots = np.full(capacity, -1, dtype=np.int32)
        self._max_size = capacity * 3 // 4

    def __len__(self) -> int:
        return self._size

    @property
    def slot_capacity(self) -> int:
        """Every slot ever handed out is below this; size the arena to at least this many rows."""
        return self._high_water

    def lookup(self, keys: npt.ArrayLike) -> npt.NDArray[np.int32]:
        """Slot of each key, -1 where the key is absent.  Does not modify the index."""
        arr = as_keys(keys, "keys")
        out = np.empty(arr.size, dtype=np.int32)
        if arr.size:
            _lookup_batch(self._keys, self._slots, arr, out)
        return out

    def lookup_or_insert(self, keys: npt.ArrayLike) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_]]:
        """Slot of each key, inserting missing keys; `created[i]` marks the first occurrence of
        each key this call inserted (the caller initialises those rows).  Duplicates in the
        batch share one slot."""
        arr = as_keys(keys, "keys")
        out = np.empty(arr.size, dtype=np.int32)
        created = np.zeros(arr.size, dtype=np.bool_)
        start = 0
        while start < arr.size:
            start, self._n_free, self._high_water, self._size, status = _insert_batch(
                self._keys,
                self._slots,
                arr,
                start,
                out,
                created,
                self._free,
                self._n_free,
                self._high_water,
                self._size,
                self._max_size,
                self._max_slots,
            )
            if status == _NEED_GROW:
                self._grow()
            elif status == _OUT_OF_SLOTS:
                self.remove(arr[:start][created[:start]])  # all-or-nothing for the caller
                raise OverflowError(
                    f"KeyIndex is out of slots: {len(self)} live keys and no free slot, and "
                    f"slots are int32 (at most {self._max_slots}); remove or evict keys first"
                )
        return out, created

    def remove(self, keys: npt.ArrayLike) -> npt.NDArray[np.int32]:
        """Remove keys; returns the slot each freed, -1 if absent (or already removed earlier in
        this batch).  Freed slots are handed out again by later inserts."""
        arr = as_keys(keys, "keys")
        out = np.empty(arr.size, dtype=np.int32)
        if not arr.size:
            return out
        # Every slot below the high-water mark is either live or free, so this bound is tight.
        needed = min(self._n_free + arr.size, self._high_water)
        if needed > self._free.size:
            grown = np.empty(min(max(needed, 2 * self._free.size), self._high_water), np.int32)
            grown[: self._n_free] = self._free[: self._n_free]
            self._free = grown
        self._n_free, self._size = _remove_batch(
            self._keys, self._slots, arr, out, self._free, self._n_free, self._size
        )
        return out

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """All live (keys, slots) as two new arrays, in bucket order."""
        keys = np.empty(self._size, dtype=np.int64)
        slots = np.empty(self._size, dtype=np.int32)
        if self._size:
            _collect(self._keys, self._slots, keys, slots)
        return keys, slots

    def buckets(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """The bucket arrays themselves (keys, slots; slot -1 = empty), not copies: for
        kernels that scan every live row. Valid until the next insert."""
        return self._keys, self._slots

    def memory_bytes(self) -> int:
        """Bytes of every array the index holds (buckets and free list)."""
        return int(self._keys.nbytes + self._slots.nbytes + self._free.nbytes)

    def _grow(self) -> None:
        old_keys, old_slots = self._keys, self._slots
        self._alloc_table(2 * old_slots.size)
        _rehash(old_keys, old_slots, self._keys, self._slots)
