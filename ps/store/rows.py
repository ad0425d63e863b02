"""``Rows``: rows of one table with everything a row carries, the unit that moves between
a table's RAM and disk halves, rescue dumps, checkpoints and reshards.

A row is its key, its ``values`` (the embedding, ``dim`` elements), its optimizer
``state`` (``state_width`` elements: Adagrad's accumulator, Adam's moments, ...; in an
8-bit serving table, which keeps no optimizer state, the row's scale and bias), its
``version`` (updates applied, which seeds the stochastic rounding of 16-bit rows; always
0 for float32 tables) and its lifecycle metadata: ``last_access`` (Unix seconds of its
last lookup or push, for LRU and TTL) and ``frequency`` (lookups, for admission and LFU).
Values and state are arrays of the table's stored types (``RowFormat``, ``ps.store.precision``).
Whatever takes a row somewhere takes all of it, so nothing is dropped on the way (the
dirty flag is not part of it: it says how a RAM row relates to its copy on disk, and
stays in RAM).

Stored form (RocksDB values, rescue dumps, reshard streams): one record per row,
little-endian: values, state, then ``version`` (uint32, 16-bit tables only),
``last_access`` and ``frequency`` (uint32 each) (``packed`` / ``unpack``). A float32
table's record is ``dim + state_width + 2`` 4-byte words, as it always was.

Arrays are shared, not copied, unless a method says otherwise: ``rows[mask]`` copies
(numpy's fancy indexing), ``rows[a:b]`` and ``unpack`` give views.

Example:
    >>> import numpy as np
    >>> r = Rows(np.array([7, 9]), np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32),
    ...          np.array([5, 6], np.uint32), np.array([1, 2], np.uint32))
    >>> len(r), r.dim, r.state_width, r[1:].keys.tolist()
    (2, 2, 1, [9])
    >>> fmt = RowFormat(dim=2, state_width=1)
    >>> back = Rows.unpack(r.keys, r.packed(fmt), fmt)
    >>> back.frequency.tolist(), back.values.tolist() == r.values.tolist()
    ([1, 2], True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from ps.store import precision

__all__ = ["RowFormat", "Rows"]


@dataclass(frozen=True)
class RowFormat:
    """How one table's rows are laid out: widths and stored element types."""

    dim: int
    state_width: int
    values: str = precision.FLOAT32
    state: str = precision.FLOAT32

    @property
    def versioned(self) -> bool:
        """True when rows carry a version (some column is rounded stochastically)."""
        return self.values in (precision.BFLOAT16, precision.FLOAT16) or self.state != precision.FLOAT32

    @cached_property
    def record(self) -> np.dtype[Any]:
        """The numpy structured dtype of one stored record."""
        fields: list[tuple[str, Any, tuple[int, ...]] | tuple[str, Any]] = [
            ("values", precision.array_dtype(self.values), (self.dim,)),
            ("state", precision.array_dtype(self.state), (self.state_width,)),
        ]
        if self.versioned:
            fields.append(("version", "<u4"))
        fields += [("last_access", "<u4"), ("frequency", "<u4")]
        return np.dtype(fields)

    @property
    def record_bytes(self) -> int:
        return int(self.record.itemsize)


@dataclass(frozen=True)
class Rows:
    """Rows of one table (see the module docstring): ``keys [n]`` int64, ``values [n, dim]``
    and ``state [n, state_width]`` in their stored types, ``last_access [n]``,
    ``frequency [n]`` and ``version [n]`` uint32 (zeros when not given)."""

    keys: npt.NDArray[np.int64]
    values: npt.NDArray[Any]
    state: npt.NDArray[Any]
    last_access: npt.NDArray[np.uint32]
    frequency: npt.NDArray[np.uint32]
    version: npt.NDArray[np.uint32] = field(default=None)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.version is None:
            object.__setattr__(self, "version", np.zeros(self.keys.shape[0], np.uint32))

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    @property
    def state_width(self) -> int:
        return int(self.state.shape[1])

    def __getitem__(self, index: Any) -> Rows:
        """The rows at ``index`` (a slice, a boolean mask or positions), every column alike."""
        return Rows(
            self.keys[index],
            self.values[index],
            self.state[index],
            self.last_access[index],
            self.frequency[index],
            self.version[index],
        )

    @classmethod
    def empty(cls, fmt: RowFormat) -> Rows:
        return cls.unpack(np.empty(0, np.int64), b"", fmt)

    @classmethod
    def concat(cls, parts: Sequence[Rows], fmt: RowFormat) -> Rows:
        """``parts`` one after the other (new arrays); ``fmt`` shapes an empty result."""
        if not parts:
            return cls.empty(fmt)
        return cls(
            np.concatenate([p.keys for p in parts]),
            np.concatenate([p.values for p in parts]),
            np.concatenate([p.state for p in parts]),
            np.concatenate([p.last_access for p in parts]),
            np.concatenate([p.frequency for p in parts]),
            np.concatenate([p.version for p in parts]),
        )

    def packed(self, fmt: RowFormat) -> npt.NDArray[np.void]:
        """The rows in their stored form, as a new ``[n]`` array of ``fmt.record``."""
        rec = np.empty(len(self), dtype=fmt.record)
        rec["values"] = self.values
        rec["state"] = self.state
        if fmt.versioned:
            rec["version"] = self.version
        rec["last_access"] = self.last_access
        rec["frequency"] = self.frequency
        return rec

    @classmethod
    def unpack(cls, keys: npt.NDArray[np.int64], records: Any, fmt: RowFormat) -> Rows:
        """Rows of ``keys`` from their stored form (``packed``'s array, or its bytes), as views."""
        rec = np.frombuffer(records, dtype=fmt.record) if isinstance(records, bytes | memoryview) else records
        rec = rec.view(fmt.record).reshape(keys.shape[0])
        version = rec["version"] if fmt.versioned else np.zeros(keys.shape[0], np.uint32)
        return cls(keys, rec["values"], rec["state"], rec["last_access"], rec["frequency"], version)
