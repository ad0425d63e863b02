"""One embedding table on one shard: key index + arena + optimizer, behind one lock.

``Table.lookup`` returns the rows of a batch of keys, creating missing rows (in
training mode) with their deterministic initial values; ``Table.push`` applies a
batch of gradients with the table's optimizer. Both are batch operations compiled
with numba: no Python loop or object per key.

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
import time
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

__all__ = ["Table", "TableCounters"]

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


class Table:
    """Rows of one table on this shard (see the module docstring for the contract)."""

    def __init__(self, spec: TableSpec, initial_capacity: int = 1024) -> None:
        self.spec = spec
        self.dim = spec.dim
        self.counters = TableCounters()
        self._lock = threading.Lock()
        self._index = KeyIndex(initial_capacity)
        self._arena = Arena(spec.dim, optimizers.state_width(spec.optimizer, spec.dim), initial_capacity)
        self._seen = np.zeros(self._arena.capacity // 8 + 1, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._index)

    def lookup(
        self, keys: npt.NDArray[np.int64], out: npt.NDArray[np.float32] | None = None, create: bool = True
    ) -> npt.NDArray[np.float32]:
        """Rows of ``keys`` in order, written into ``out`` (``[len(keys), dim]`` float32) or a new array.

        With ``create`` (training), missing keys get their initial rows stored; without
        it (serving), missing keys read as zeros and nothing is stored.
        """
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if out is None:
            out = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        elif out.shape != (keys.shape[0], self.dim) or out.dtype != np.float32 or not out.flags.c_contiguous:
            # The gather kernel does not bounds-check: a wrong buffer would corrupt memory.
            raise ValueError(f"out: {out.dtype}{list(out.shape)}, expected C-contiguous float32[{keys.shape[0]}, {self.dim}]")
        now = np.uint32(int(time.time()))
        with self._lock:
            if create:
                slots = self._slots_for(keys, now)
            else:
                slots = self._index.lookup(keys)
            a = self._arena
            _gather(a.values, slots, out, a.last_access, a.frequency, now)
            self.counters.lookups += keys.shape[0]
        return out

    def push(self, keys: npt.NDArray[np.int64], grads: npt.NDArray[np.float32], *, check: bool = True) -> int:
        """Apply ``grads[i]`` to the row of ``keys[i]`` with the table's optimizer.

        Gradients of duplicate keys are summed first; missing keys get their initial
        row before the update. Raises ``InvalidRequest`` (nothing applied) for a wrong
        shape or a NaN/Inf value; ``check=False`` skips that scan for a caller that
        already ran ``validate_grads`` on these arrays. Returns the number of distinct
        rows updated.
        """
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if check:
            self.validate_grads(keys, grads)
        now = np.uint32(int(time.time()))
        with self._lock:
            slots = self._slots_for(keys, now)
            if _has_duplicates(slots, self._seen):
                unique, inverse = np.unique(slots, return_inverse=True)
                summed = np.zeros((unique.shape[0], self.dim), dtype=np.float32)
                np.add.at(summed, inverse, grads)
                slots, grads = unique.astype(np.int32), summed
            a = self._arena
            optimizers.apply(self.spec.optimizer, a.values, a.state, slots, grads)
            _mark_pushed(slots, a.last_access, a.dirty, now)
            self.counters.pushes += slots.shape[0]
        return int(slots.shape[0])

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

    def remove(self, keys: npt.NDArray[np.int64]) -> int:
        """Drop the rows of ``keys`` (absent keys are ignored); returns how many were dropped."""
        with self._lock:
            return int((self._index.remove(np.ascontiguousarray(keys, dtype=np.int64)) >= 0).sum())

    def export(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Copies of every stored ``(keys, values, optimizer state)``, in no particular order."""
        with self._lock:
            keys, slots = self._index.items()
            return keys, self._arena.values[slots], self._arena.state[slots]

    def memory_bytes(self) -> int:
        """Bytes held by the index, the arena and scratch space."""
        with self._lock:
            return self._index.memory_bytes() + self._arena.memory_bytes() + self._seen.nbytes

    def _slots_for(self, keys: npt.NDArray[np.int64], now: np.uint32) -> npt.NDArray[np.int32]:
        """Slots of ``keys``, creating and initialising missing rows. Caller holds the lock."""
        slots, created = self._index.lookup_or_insert(keys)
        if created.any():
            a = self._arena
            if self._index.slot_capacity > a.capacity:
                a.ensure_capacity(self._index.slot_capacity)
                self._seen = np.zeros(a.capacity // 8 + 1, dtype=np.uint8)
            new = slots[created].astype(np.int64)
            fill_initial_rows(self.spec.initializer, self.spec.seed, keys[created], a.values, new)
            optimizers.init_state(self.spec.optimizer, a.state, new)
            a.frequency[new] = 0
            a.last_access[new] = now
            a.dirty[new] = 1
            self.counters.rows_created += new.shape[0]
        return slots
