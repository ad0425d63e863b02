"""``Rows``: rows of one table with everything a row carries, the unit that moves between
a table's RAM and disk halves, rescue dumps, checkpoints and reshards.

A row is its key, its ``values`` (the embedding, ``dim`` float32), its optimizer
``state`` (``state_width`` float32: Adagrad's accumulator, Adam's moments, ...) and its
lifecycle metadata: ``last_access`` (Unix seconds of its last lookup or push, for LRU
and TTL) and ``frequency`` (lookups, for admission and LFU). Whatever takes a row
somewhere takes all five, so none is dropped on the way (the dirty flag is not part
of it: it says how a RAM row relates to its copy on disk, and stays in RAM).

Stored form (RocksDB values, rescue dumps): one ``[n, dim + state_width + 2]`` array
of 4-byte little-endian words per batch of rows, the last two words of each row
holding ``last_access`` and ``frequency`` as uint32 (``packed`` / ``unpack``).

Arrays are shared, not copied, unless a method says otherwise: ``rows[mask]`` copies
(numpy's fancy indexing), ``rows[a:b]`` and ``unpack`` give views.

Example:
    >>> import numpy as np
    >>> r = Rows(np.array([7, 9]), np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32),
    ...          np.array([5, 6], np.uint32), np.array([1, 2], np.uint32))
    >>> len(r), r.dim, r.state_width, r[1:].keys.tolist()
    (2, 2, 1, [9])
    >>> back = Rows.unpack(r.keys, r.packed(), dim=2, state_width=1)
    >>> back.frequency.tolist(), back.values.tolist() == r.values.tolist()
    ([1, 2], True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Rows"]


@dataclass(frozen=True)
class Rows:
    """Rows of one table (see the module docstring): ``keys [n]`` int64, ``values [n, dim]``
    and ``state [n, state_width]`` float32, ``last_access [n]`` and ``frequency [n]`` uint32."""

    keys: npt.NDArray[np.int64]
    values: npt.NDArray[np.float32]
    state: npt.NDArray[np.float32]
    last_access: npt.NDArray[np.uint32]
    frequency: npt.NDArray[np.uint32]

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    @property
    def state_width(self) -> int:
        return int(self.state.shape[1])

    @property
    def width(self) -> int:
        """Words per row in the stored form."""
        return self.dim + self.state_width + 2

    def __getitem__(self, index: Any) -> Rows:
        """The rows at ``index`` (a slice, a boolean mask or positions), every column alike."""
        return Rows(
            self.keys[index], self.values[index], self.state[index], self.last_access[index], self.frequency[index]
        )

    @classmethod
    def empty(cls, dim: int, state_width: int) -> Rows:
        return cls(
            np.empty(0, np.int64),
            np.empty((0, dim), np.float32),
            np.empty((0, state_width), np.float32),
            np.empty(0, np.uint32),
            np.empty(0, np.uint32),
        )

    @classmethod
    def concat(cls, parts: Sequence[Rows], dim: int, state_width: int) -> Rows:
        """``parts`` one after the other (new arrays); ``dim``/``state_width`` shape an empty result."""
        if not parts:
            return cls.empty(dim, state_width)
        return cls(
            np.concatenate([p.keys for p in parts]),
            np.concatenate([p.values for p in parts]),
            np.concatenate([p.state for p in parts]),
            np.concatenate([p.last_access for p in parts]),
            np.concatenate([p.frequency for p in parts]),
        )

    def packed(self) -> npt.NDArray[np.float32]:
        """The rows in their stored form, as a new ``[n, width]`` float32 array."""
        d, w = self.dim, self.width
        rec = np.empty((len(self), w), dtype=np.float32)
        rec[:, :d] = self.values
        rec[:, d : w - 2] = self.state
        words = rec.view(np.uint32)
        words[:, w - 2] = self.last_access
        words[:, w - 1] = self.frequency
        return rec

    @classmethod
    def unpack(cls, keys: npt.NDArray[np.int64], records: Any, dim: int, state_width: int) -> Rows:
        """Rows of ``keys`` from their stored form (``packed``'s array, or its bytes), as views."""
        w = dim + state_width + 2
        rec = np.frombuffer(records, dtype=np.float32) if isinstance(records, bytes) else records
        rec = rec.reshape(keys.shape[0], w)
        words = rec.view(np.uint32)
        return cls(keys, rec[:, :dim], rec[:, dim : w - 2], words[:, w - 2], words[:, w - 1])
