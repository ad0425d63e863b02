"""Multi-valued categorical columns: a field such as ``a|b|c`` holds several keys of one feature.

``split_keys`` splits the fields of one column at a separator byte and hashes every value
with the feature's FNV basis, through ``protos.hashing.hash_fields`` (the kernel every
other key goes through, so a value hashes as it would alone in a categorical column).
Empty values are left out: an empty field is a row with no keys (its pooled row is zeros),
and ``a||b`` or ``a|b|`` hold the keys of ``a`` and ``b``. A value that appears twice in
one field is two keys (sum pooling counts it twice). The click-log readers
(``worker.data``) and the predictor (``worker.predictor``) both call it, so a request's
``"a|b"`` becomes the keys training saw. No Python object per value.

``JaggedKeys`` holds one such feature for many rows, as numpy ``values`` + ``offsets``
(the layout of ``worker.jagged.JaggedIds``), with the row operations the readers need:
slices, gathers and concatenation.

Example:
    >>> from protos.hashing import fnv_basis, hash_strings
    >>> buf = np.frombuffer(b"a|bc||", np.uint8)
    >>> bag = split_keys(buf, np.array([0, 6]), np.array([6, 6]), ord("|"), fnv_basis(7))
    >>> bag.offsets.tolist(), bag.values.tolist() == hash_strings(["a", "bc"], 7).tolist()
    ([0, 2, 2], True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

from protos.hashing import hash_fields

__all__ = ["JaggedKeys", "split_keys", "split_values"]

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


@numba.njit(nogil=True, cache=True)
def _count_values(buf: U8, starts: I64, ends: I64, sep: int, counts: I64) -> None:
    """``counts[i]``: the non-empty values of field ``[starts[i], ends[i])`` split at ``sep``."""
    for i in range(starts.shape[0]):
        n, run = 0, 0
        for p in range(starts[i], ends[i]):
            if buf[p] == sep:
                n += run > 0
                run = 0
            else:
                run += 1
        counts[i] = n + (run > 0)


@numba.njit(nogil=True, cache=True)
def _value_ranges(buf: U8, starts: I64, ends: I64, sep: int, offsets: I64, out_starts: I64, out_ends: I64) -> None:
    """The byte range of every non-empty value, row after row (``offsets`` from ``_count_values``)."""
    for i in range(starts.shape[0]):
        k, begin = offsets[i], starts[i]
        for p in range(starts[i], ends[i] + 1):
            if p == ends[i] or buf[p] == sep:
                if p > begin:
                    out_starts[k], out_ends[k] = begin, p
                    k += 1
                begin = p + 1


def split_values(buf: U8, starts: I64, ends: I64, sep: int) -> tuple[I64, I64, I64]:
    """``(offsets, value_starts, value_ends)``: the non-empty values of each field
    ``buf[starts[i]:ends[i]]`` split at the byte ``sep``; row ``i`` owns the values
    ``offsets[i]:offsets[i + 1]``. Two passes of a numba kernel, no Python object per value.

    >>> split_values(np.frombuffer(b"x|yy", np.uint8), np.array([0]), np.array([4]), ord("|"))[1:]
    (array([0, 2]), array([1, 4]))
    """
    counts = np.empty(starts.shape[0], np.int64)
    _count_values(buf, starts, ends, sep, counts)
    offsets = np.zeros(starts.shape[0] + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    out_starts, out_ends = np.empty(int(offsets[-1]), np.int64), np.empty(int(offsets[-1]), np.int64)
    _value_ranges(buf, starts, ends, sep, offsets, out_starts, out_ends)
    return offsets, out_starts, out_ends


def split_keys(buf: U8, starts: I64, ends: I64, sep: int, basis: int) -> JaggedKeys:
    """The keys of each field ``buf[starts[i]:ends[i]]``: its values split at ``sep``, each
    hashed under ``basis`` (``fnv_basis(seed)``) as ``hash_feature(value, seed)`` hashes it."""
    offsets, value_starts, value_ends = split_values(buf, starts, ends, sep)
    keys = np.empty((1, value_starts.shape[0]), np.uint64)
    if value_starts.shape[0]:
        hash_fields(
            buf, value_starts[:, None], value_ends[:, None], np.zeros(1, np.int64), np.array([basis], np.uint64), keys
        )
    return JaggedKeys(keys[0].view(np.int64), offsets)


@dataclass(frozen=True)
class JaggedKeys:
    """The keys of one multi-valued feature for ``len(self)`` rows: row ``i`` owns
    ``values[offsets[i]:offsets[i + 1]]`` (int64 both; ``offsets`` starts at 0 and ends at
    ``len(values)``). Immutable by convention: ``rows`` returns views of ``values``.

    >>> bag = JaggedKeys(np.array([5, 6, 7]), np.array([0, 2, 2, 3]))
    >>> len(bag), bag.rows(1, 3).offsets.tolist(), bag.take(np.array([2, 0])).values.tolist()
    (3, [0, 0, 1], [7, 5, 6])
    """

    values: I64
    offsets: I64

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def lengths(self) -> I64:
        """Keys per row, ``[len(self)]``."""
        out: I64 = np.diff(self.offsets)
        return out

    def rows(self, lo: int, hi: int) -> JaggedKeys:
        """Rows ``[lo, hi)`` (clipped to the rows there are)."""
        lo, hi = min(max(lo, 0), len(self)), min(max(hi, 0), len(self))
        hi = max(lo, hi)
        first = self.offsets[lo]
        return JaggedKeys(self.values[first : self.offsets[hi]], self.offsets[lo : hi + 1] - first)

    def take(self, order: I64) -> JaggedKeys:
        """The rows ``order`` (any row indices, in that order), vectorised."""
        lengths = self.lengths()[order]
        offsets = np.zeros(order.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        at = np.repeat(self.offsets[:-1][order] - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return JaggedKeys(self.values[at], offsets)

    def with_values(self, values: I64) -> JaggedKeys:
        """The same rows holding ``values`` instead (as many as there are now)."""
        if values.shape != self.values.shape:
            raise ValueError(f"values: {values.shape}, expected {self.values.shape}")
        return JaggedKeys(values, self.offsets)

    @staticmethod
    def concat(parts: Sequence[JaggedKeys]) -> JaggedKeys:
        """The rows of ``parts`` one after another."""
        if len(parts) == 1:
            return parts[0]
        shift = np.cumsum([0, *(p.values.shape[0] for p in parts[:-1])])
        offsets = np.concatenate([[0], *(p.offsets[1:] + s for p, s in zip(parts, shift))]).astype(np.int64)
        values = np.concatenate([p.values for p in parts]) if parts else np.empty(0, np.int64)
        return JaggedKeys(values.astype(np.int64, copy=False), offsets)
