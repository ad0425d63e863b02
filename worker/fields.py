"""What a click log's raw fields become: numbers, dense values, bucket keys.

The click-log readers (``worker.data``) and the predictor (``worker.predictor``) both
call these, so a value served is transformed exactly as it was in training. Fields are
``[start, end)`` byte ranges of one ``uint8`` buffer, parsed by a numba kernel with no
Python object per value.

Example:
    >>> raw, empty = np.array([0.0, 5.0, 0.0]), np.array([False, False, True])
    >>> dense_values(raw, log_transform=True).tolist(), bucket_ids(raw, empty).tolist()[:2]
    ([0.0, 1.7917594909667969, 0.0], [0, 5])
"""

from __future__ import annotations

import math

import numba
import numpy as np
import numpy.typing as npt

from protos.keys import hash_features

__all__ = ["MISSING_BUCKET", "bucket_ids", "bucket_keys", "dense_values", "parse_numbers"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

MISSING_BUCKET = int(np.iinfo(np.int64).min)
"""The bucket id of an empty dense field."""


@numba.njit(nogil=True, cache=True)
def _parse_numbers(buf: U8, starts: I64, ends: I64, cols: I64, out: F64, status: U8) -> None:
    """``[+-]digits[.digits]`` -> out; status 0 ok, 1 empty, 2 anything else (left to Python)."""
    for i in range(starts.shape[0]):
        for c in range(cols.shape[0]):
            s, e = starts[i, cols[c]], ends[i, cols[c]]
            out[i, c], status[i, c] = 0.0, 1 if s == e else 2
            if s == e:
                continue
            p, neg = s, buf[s] == 45
            if buf[p] == 45 or buf[p] == 43:
                p += 1
            v, digits, scale = 0.0, 0, 0
            while p < e and 48 <= buf[p] <= 57:
                v, digits, p = v * 10.0 + (buf[p] - 48), digits + 1, p + 1
            if p < e and buf[p] == 46:
                p += 1
                while p < e and 48 <= buf[p] <= 57:
                    v, digits, scale, p = v * 10.0 + (buf[p] - 48), digits + 1, scale - 1, p + 1
            if digits == 0 or p != e or digits > 15:  # > 15 digits may not be exact in float64
                continue
            v /= 10.0 ** (-scale)  # an exact power of ten: correctly rounded for short decimals
            if math.isfinite(v):
                out[i, c] = -v if neg else v
                status[i, c] = 0


def bucket_ids(raw: F64, missing: npt.NDArray[np.bool_]) -> I64:
    """Log-scale bucket of each parsed dense value: ``floor(v)`` for v <= 2, ``3 + floor(ln(v)**2)``
    above, ``MISSING_BUCKET`` where ``missing`` (see ``ColumnSchema.dense_buckets``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        above = 3.0 + np.floor(np.log(np.maximum(raw, 3.0)) ** 2)
    ids = np.clip(np.where(raw > 2.0, above, np.floor(raw)), -(2.0**62), 2.0**62).astype(np.int64)
    out: I64 = np.where(missing, MISSING_BUCKET, ids)
    return out


def parse_numbers(buf: U8, starts: I64, ends: I64, cols: I64) -> tuple[F64, npt.NDArray[np.bool_], I64]:
    """The numbers in the byte ranges ``buf[starts[i, cols[c]]:ends[i, cols[c]]]``, parsed as the readers do.

    Returns ``(values, empty, bad)``: float64 ``[n, len(cols)]`` (0 for an empty field),
    which fields were empty, and the ``(row, c)`` pairs, in row order, of fields that
    are not a finite number (their value is NaN or infinite). A numba kernel parses
    ``[+-]digits[.digits]``; other forms (exponents, long digit runs) go to ``float()``.

    >>> buf = np.frombuffer(b"12-0.5x", np.uint8)
    >>> v, e, bad = parse_numbers(buf, np.array([[0], [2], [6], [2]]), np.array([[2], [6], [7], [2]]), np.zeros(1, np.int64))
    >>> v[:2, 0].tolist(), e[:, 0].tolist(), bad.tolist()
    ([12.0, -0.5], [False, False, False, True], [[2, 0]])
    """
    n = starts.shape[0]
    out, status = np.empty((n, cols.shape[0]), np.float64), np.empty((n, cols.shape[0]), np.uint8)
    _parse_numbers(buf, starts, ends, cols, out, status)
    bad: list[tuple[int, int]] = []
    for i, c in np.argwhere(status == 2):  # rare: forms the kernel leaves to Python, or garbage
        try:
            out[i, c] = float(bytes(buf[starts[i, cols[c]] : ends[i, cols[c]]]))
        except ValueError:
            out[i, c] = math.nan
        if not math.isfinite(out[i, c]):
            bad.append((int(i), int(c)))
    return out, status == 1, np.array(bad, np.int64).reshape(-1, 2)


def dense_values(raw: F64, log_transform: bool) -> npt.NDArray[np.float32]:
    """What a dense column's parsed values (0 where empty) become in ``Batch.dense``:
    ``log1p(max(x, 0))`` in float64 when ``log_transform``, then float32."""
    out: npt.NDArray[np.float32] = (np.log1p(np.maximum(raw, 0.0)) if log_transform else raw).astype(np.float32)
    return out


def bucket_keys(raw: F64, empty: npt.NDArray[np.bool_], seed: int) -> I64:
    """Keys of a dense column's bucket feature (see ``ColumnSchema.dense_buckets``) for
    parsed values ``raw`` (0 where ``empty``), hashed with ``seed``."""
    return hash_features(bucket_ids(raw, empty), seed)
