"""Row storage of one table, indexed by slot: values, optimizer state and metadata.

One contiguous array per column, grown by doubling (only the used prefix is copied;
untouched pages of the new capacity cost no resident memory). Per slot it keeps:

* ``values``      ``[capacity, dim]`` in the table's storage type: the embedding rows;
* ``state``       ``[capacity, state_width]`` in its state type: the optimizer's per-row state;
* ``version``     uint32: updates applied, for the stochastic rounding of 16-bit rows
  (``ps.store.precision``; a 0-length column in float32 tables, which never read it);
* ``last_access`` uint32: Unix seconds of the last lookup or push (for LRU and TTL);
* ``frequency``   uint32: lookups of the key, saturating (for admission and LFU);
* ``dirty``       uint8: 1 if changed since it was last persisted.

The slot numbers come from the table's ``KeyIndex``; the arena never allocates them.
Not thread-safe: the owning ``Table`` holds its lock around every use.

Example:
    >>> a = Arena(RowFormat(dim=4, state_width=4), capacity=2)
    >>> a.ensure_capacity(5)
    >>> a.capacity, a.values.shape
    (8, (8, 4))
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ps.store import RowFormat, Rows, precision

__all__ = ["Arena"]


class Arena:
    """Columns of per-slot storage for one table (see the module docstring)."""

    def __init__(self, fmt: RowFormat, capacity: int = 1024) -> None:
        self.format = fmt
        self.dim = fmt.dim
        self.state_width = fmt.state_width
        self.capacity = 0
        self.values: npt.NDArray[Any] = np.empty((0, fmt.dim), dtype=precision.array_dtype(fmt.values))
        self.state: npt.NDArray[Any] = np.empty((0, fmt.state_width), dtype=precision.array_dtype(fmt.state))
        self.version: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self.last_access: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self.frequency: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self.dirty: npt.NDArray[np.uint8] = np.empty(0, dtype=np.uint8)
        self._resize(max(1, capacity))

    @property
    def row_bytes(self) -> int:
        """Bytes one slot takes across every column."""
        return self.format.record_bytes + 1  # the record's columns and the dirty flag

    def ensure_capacity(self, slots: int) -> None:
        """Grow (by doubling) so that every slot ``< slots`` exists; contents are kept."""
        if slots > self.capacity:
            new = self.capacity
            while new < slots:
                new *= 2
            self._resize(new)

    def rows(self, keys: npt.NDArray[np.int64], slots: npt.NDArray[np.int32]) -> Rows:
        """Copies of the rows at ``slots``, as the rows of ``keys``."""
        version = self.version[slots] if self.format.versioned else np.zeros(len(slots), np.uint32)
        return Rows(
            keys, self.values[slots], self.state[slots], self.last_access[slots], self.frequency[slots], version
        )

    def memory_bytes(self) -> int:
        """Bytes of the allocated columns (resident only as far as they were written)."""
        return self.capacity * self.row_bytes

    def _resize(self, capacity: int) -> None:
        keep = min(self.capacity, capacity)

        def grown(old: npt.NDArray[np.generic], shape: tuple[int, ...]) -> npt.NDArray[np.generic]:
            new = np.empty(shape, dtype=old.dtype)
            new[:keep] = old[:keep]
            return new

        self.values = grown(self.values, (capacity, self.dim))
        self.state = grown(self.state, (capacity, self.state_width))
        if self.format.versioned:
            self.version = grown(self.version, (capacity,))  # type: ignore[assignment]
        self.last_access = grown(self.last_access, (capacity,))  # type: ignore[assignment]
        self.frequency = grown(self.frequency, (capacity,))  # type: ignore[assignment]
        self.dirty = grown(self.dirty, (capacity,))  # type: ignore[assignment]
        self.capacity = capacity
