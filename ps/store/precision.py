"""Row storage types and the rounding that takes float32 rows to them.

A table stores its values as ``float32`` (the default), ``bfloat16`` or ``float16``, and
its optimizer state as ``float32`` (the default) or ``bfloat16``. 16-bit elements are
kept as their raw bits: ``uint16`` arrays for bfloat16, numpy ``float16`` for float16.

Every update is computed in float32 and rounded back to the stored type by
**stochastic rounding**: ``x`` between two neighbours ``lo < x < hi`` of the stored type
becomes ``hi`` with probability ``(x - lo) / (hi - lo)``, so the rounding error has mean
zero and small updates are not lost. The random number of element ``j`` is a pure
function of the table seed, the key, the row's version (its update count) and ``j``:

    ``r = mix64(key ^ mix64(seed) ^ version * 0xD1B54A32D192ED03)``
    ``w(i) = mix64(r + (i + 1) * 0x9E3779B97F4A7C15)``

bfloat16 takes 16 bits per element, four to a word: element ``j`` adds bits
``16 * (j % 4)`` and up of ``w(j // 4)`` below its kept bits. float16 takes the top 53 bits
of ``w(j)`` as a uniform draw. So a run is reproducible, any cluster size rounds a row the
same way, and a local twin that rounds alike gives the shards' rows bit for bit. State
columns draw ``j + dim``.
Initial rows (and any row written whole, such as a followed one) are rounded to the
nearest stored value instead: they are deterministic already.

float16 holds magnitudes up to 65504: a larger result is clamped to +-65504 and counted
(``Rounding.clamped``), never stored as Inf. A non-zero result rounded to zero is
counted in ``Rounding.flushed``. bfloat16 has float32's range: only a result beyond its
largest finite value is clamped.

Example:
    >>> x = np.full((1, 4), 1.0 + 2**-9, np.float32)  # a quarter of the way to the next bfloat16
    >>> bits = np.zeros((1, 4), np.uint16)
    >>> counts = Rounding()
    >>> round_into(BFLOAT16, x, bits, np.array([5]), np.array([1], np.uint32), seed=0, first=0, counts=counts)
    >>> sorted(set(decode(BFLOAT16, bits).ravel().tolist()))  # each element one of the two
    [1.0, 1.0078125]
    >>> decode(BFLOAT16, encode_nearest(BFLOAT16, x)).ravel().tolist()  # nearest
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import rowkernels
from protos.hashing import mix64_step
from protos.keys import mix64
from protos.rowtypes import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    INT8,
    Rounding,
    decode,
    dequantize,
    encode_nearest,
    quantize,
)

__all__ = [
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "INT8",
    "SERVE_TYPES",
    "STATE_TYPES",
    "STORAGE_TYPES",
    "Rounding",
    "array_dtype",
    "decode",
    "gather_float32",
    "from_bytes",
    "from_wire",
    "to_wire",
    "travelling",
    "dequantize",
    "quantize",
    "widen",
    "encode_nearest",
    "itemsize",
    "round_into",
    "to_wire_rows",
]

STORAGE_TYPES = (FLOAT32, BFLOAT16, FLOAT16)  # what a training table may store
SERVE_TYPES = (*STORAGE_TYPES, INT8)  # what a serving shard may hold its rows as
STATE_TYPES = (FLOAT32, BFLOAT16)  # float16 state would overflow Adagrad/Adam accumulators

_ARRAY_DTYPES: dict[str, np.dtype[Any]] = {
    FLOAT32: np.dtype("<f4"),
    BFLOAT16: np.dtype("<u2"),
    FLOAT16: np.dtype("<f2"),
    INT8: np.dtype("u1"),
}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_VERSION_MIX = np.uint64(0xD1B54A32D192ED03)
_F16_MAX_BITS = np.uint16(0x7BFF)  # 65504
_BF16_MAX_BITS = np.uint16(0x7F7F)  # bfloat16's largest finite value (as protos.rowtypes clamps to)


def array_dtype(kind: str) -> np.dtype[Any]:
    """The numpy dtype of arrays holding elements stored as ``kind`` (uint16 for bfloat16)."""
    return _ARRAY_DTYPES[kind]


def itemsize(kind: str) -> int:
    return _ARRAY_DTYPES[kind].itemsize


_FROM_WIRE: dict[int, str] = {
    pb.DTYPE_UNSPECIFIED: FLOAT32,
    pb.FLOAT32: FLOAT32,
    pb.BFLOAT16: BFLOAT16,
    pb.FLOAT16: FLOAT16,
    pb.INT8: INT8,
}
_TO_WIRE: dict[str, pb.DType] = {FLOAT32: pb.FLOAT32, BFLOAT16: pb.BFLOAT16, FLOAT16: pb.FLOAT16, INT8: pb.INT8}


def from_wire(dtype: int) -> str | None:
    """The storage type a wire ``DType`` names (None for an unknown number)."""
    return _FROM_WIRE.get(dtype)


def to_wire(kind: str) -> pb.DType:
    return _TO_WIRE[kind]


def from_bytes(kind: str, buf: bytes, n: int, dim: int, field: str) -> npt.NDArray[Any]:
    """``[n, dim]`` stored elements of ``kind`` in ``buf`` (a read-only view); ``ValueError``
    naming ``field`` when the length does not match."""
    dtype = _ARRAY_DTYPES[kind]
    if len(buf) != n * dim * dtype.itemsize:
        raise ValueError(f"{field}: {len(buf)} bytes, expected {n} x {dim} {kind} ({n * dim * dtype.itemsize})")
    return np.frombuffer(buf, dtype=dtype).reshape(n, dim)


# -- decoding ------------------------------------------------------------------------------


def travelling(kind: str, values: npt.NDArray[Any], state: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A table's stored ``values`` as rows travel to another table (Follow, ``Table.assign``):
    8-bit codes dequantized with their scale and bias (``state``), other types as stored."""
    if kind == INT8:  # codes mean nothing without their scale and bias
        return dequantize(values, state)
    return np.ascontiguousarray(values)


def widen(values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Rows of 16-bit elements as they travel (uint16: bfloat16 bits; float16; float32) as float32."""
    if values.dtype == np.uint16:
        return decode(BFLOAT16, values)
    return np.asarray(values, dtype=np.float32)


@numba.njit(inline="always")
def bfloat16_bits_to_float32_bits(bits: np.uint16) -> np.uint32:
    return np.uint32(bits) << np.uint32(16)


@numba.njit(inline="always")
def float16_bits_to_float32_bits(h: np.uint16) -> np.uint32:
    """The float32 bits of the float16 with bits ``h`` (subnormals, Inf and NaN included)."""
    sign = np.uint32(h & 0x8000) << np.uint32(16)
    exp = np.uint32((h >> 10) & 0x1F)
    man = np.uint32(h & 0x3FF)
    if exp == 0x1F:
        return sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    if exp == 0:
        if man == 0:
            return sign
        e = np.uint32(113)  # 127 - 15 + 1: renormalise the subnormal
        while (man & np.uint32(0x400)) == 0:
            man <<= np.uint32(1)
            e -= np.uint32(1)
        return sign | (e << np.uint32(23)) | ((man & np.uint32(0x3FF)) << np.uint32(13))
    return sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))


def gather_float32(kind: str, stored: npt.NDArray[Any], slots: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.float32]:
    """The rows ``slots`` of ``stored`` (elements stored as ``kind``: float32 or 16-bit) as a
    new float32 array: ``decode(kind, stored[slots])`` in one pass."""
    if kind == FLOAT32:
        return np.asarray(stored[slots], dtype=np.float32)
    out = np.empty((slots.shape[0], stored.shape[1]), np.float32)
    if kind == BFLOAT16:  # a kernel of its own: a branch-free loop that vectorises
        _gather_bfloat16(stored, slots, out.view(np.uint32))
    elif kind == FLOAT16:
        _gather_float16(stored.view(np.uint16), slots, out.view(np.uint32))
    else:
        raise ValueError(f"gather_float32: {kind} elements are not rounded by updates")
    return out


@numba.njit(nogil=True, cache=True)
def _gather_bfloat16(
    stored: npt.NDArray[np.uint16], slots: npt.NDArray[np.integer[Any]], out: npt.NDArray[np.uint32]
) -> None:
    for i in range(slots.shape[0]):
        row = slots[i]
        for j in range(stored.shape[1]):
            out[i, j] = np.uint32(np.uint32(stored[row, j]) << np.uint32(16))


@numba.njit(nogil=True, cache=True)
def _gather_float16(
    stored: npt.NDArray[np.uint16], slots: npt.NDArray[np.integer[Any]], out: npt.NDArray[np.uint32]
) -> None:
    for i in range(slots.shape[0]):
        row = slots[i]
        for j in range(stored.shape[1]):
            out[i, j] = float16_bits_to_float32_bits(stored[row, j])


# -- rounding to the stored type -----------------------------------------------------------


@numba.njit(inline="always")
def _uniform_word(base: np.uint64, j: int) -> np.uint64:
    return mix64_step(base + np.uint64(j + 1) * _GOLDEN)


@numba.njit(nogil=True, cache=True)
def _round_bfloat16(
    x: npt.NDArray[np.uint32],
    out: npt.NDArray[np.uint16],
    at: npt.NDArray[np.int64],
    keys: npt.NDArray[np.uint64],
    versions: npt.NDArray[np.uint32],
    seed_mix: np.uint64,
    first: int,
    counts: npt.NDArray[np.int64],
) -> None:
    # The noise of a row first (lane l of a word is its bits 16*l and up), then one
    # branch-free pass over the elements, whose types are spelled out so that it stays in
    # 32-bit lanes (vectorised). A row that may clamp or flush to zero, known from its
    # largest and smallest non-zero magnitude, is checked again.
    skip = first & 3
    noise = np.empty(4 * ((skip + x.shape[1] + 3) // 4), np.uint16)
    for i in range(x.shape[0]):
        base = mix64_step(keys[i] ^ seed_mix ^ (np.uint64(versions[i]) * _VERSION_MIX))
        for q in range(noise.shape[0] // 4):
            word = _uniform_word(base, (first >> 2) + q)
            for lane in range(4):
                noise[4 * q + lane] = np.uint16((word >> np.uint64(16 * lane)) & np.uint64(0xFFFF))
        row = at[i]
        hi = np.uint32(0)
        lo = np.uint32(0xFFFFFFFF)
        for j in range(x.shape[1]):
            bits = x[i, j]
            # Sign and magnitude: adding below the kept bits moves the magnitude up with
            # probability (dropped bits) / 2**16, whatever the sign.
            out[row, j] = np.uint16(np.uint32(bits + np.uint32(noise[skip + j])) >> np.uint32(16))
            magnitude = np.uint32(bits & np.uint32(0x7FFFFFFF))
            hi = max(hi, magnitude)
            lo = min(lo, np.uint32(magnitude - np.uint32(1)))  # zero wraps to the top
        if hi >= np.uint32(0x7F7F0001) or lo < np.uint32(0xFFFF):
            for j in range(x.shape[1]):
                r = out[row, j]
                if (r & np.uint16(0x7F80)) == np.uint16(0x7F80):
                    out[row, j] = (r & np.uint16(0x8000)) | _BF16_MAX_BITS
                    counts[0] += 1
                elif (r & np.uint16(0x7FFF)) == 0 and (x[i, j] & np.uint32(0x7FFFFFFF)) != 0:
                    counts[1] += 1


@numba.njit(nogil=True, cache=True)
def _round_float16(
    x: npt.NDArray[np.float32],
    out: npt.NDArray[np.uint16],
    at: npt.NDArray[np.int64],
    keys: npt.NDArray[np.uint64],
    versions: npt.NDArray[np.uint32],
    seed_mix: np.uint64,
    first: int,
    counts: npt.NDArray[np.int64],
) -> None:
    for i in range(x.shape[0]):
        base = mix64_step(keys[i] ^ seed_mix ^ (np.uint64(versions[i]) * _VERSION_MIX))
        src = x[i]
        dst = out[at[i]]
        for j in range(x.shape[1]):
            v = np.float64(src[j])
            sign = np.uint16(0x8000) if v < 0.0 else np.uint16(0)
            a = abs(v)
            if a > 65504.0:
                dst[j] = sign | _F16_MAX_BITS
                counts[0] += 1
                continue
            if a == 0.0:
                dst[j] = sign
                continue
            # float16 values near a are n * 2**(e - 10), e = floor(log2 a), at least -14
            # (the subnormals): the bits are (e + 14) * 1024 + n, carries included.
            e = max(math.frexp(a)[1] - 1, -14)
            q = a * 2.0 ** (10 - e)  # exact: a scaling by a power of two
            n = math.floor(q)
            u = np.float64(_uniform_word(base, first + j) >> np.uint64(11)) * (1.0 / 9007199254740992.0)
            if u < q - n:
                n += 1
            bits = np.uint16(min((e + 14) * 1024 + n, 0x7BFF))
            if bits == 0:
                counts[1] += 1
            dst[j] = sign | bits


def round_into(
    kind: str,
    rows: npt.NDArray[np.float32],
    out: npt.NDArray[Any],
    keys: npt.NDArray[np.int64],
    versions: npt.NDArray[np.uint32],
    *,
    seed: int,
    first: int,
    counts: Rounding,
    at: npt.NDArray[np.integer[Any]] | None = None,
) -> None:
    """Write ``rows`` (float32 ``[n, w]``) into the stored array ``out`` (at its rows ``at``,
    or its first ``n`` rows) with stochastic rounding drawn from (seed, ``keys[i]``,
    ``versions[i]``, ``first + j``)."""
    where = np.arange(rows.shape[0], dtype=np.int64) if at is None else np.ascontiguousarray(at, dtype=np.int64)
    if kind == FLOAT32:
        out[where] = rows
        return
    x = np.ascontiguousarray(rows, dtype=np.float32)
    k = np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64)
    v = np.ascontiguousarray(versions, dtype=np.uint32)
    seed_mix = np.uint64(mix64(seed & ((1 << 64) - 1)))
    tally = np.zeros(2, np.int64)
    target = out.view(np.uint16)
    if kind == BFLOAT16:
        _round_bfloat16(x.view(np.uint32), target, where, k, v, seed_mix, first, tally)
    else:
        _round_float16(x, target, where, k, v, seed_mix, first, tally)
    counts.clamped += int(tally[0])
    counts.flushed += int(tally[1])


# -- lookups in a 16-bit wire type ----------------------------------------------------------


def to_wire_rows(rows: npt.NDArray[np.float32], out: npt.NDArray[Any]) -> None:
    """Write float32 ``rows`` into ``out``, a float16 or bfloat16-bits (uint16) array of the
    same shape, rounded to nearest (what ``protos.wire.rows_to_dtype`` gives), in one pass."""
    if out.dtype == np.uint16:
        if rows.shape != out.shape or not (rows.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError(f"to_wire_rows: rows {rows.shape} and out {out.shape} must be alike and C-contiguous")
        rowkernels.bfloat16_nearest(rows.reshape(-1).view(np.uint32), out.reshape(-1))
    else:
        np.copyto(out, rows, casting="same_kind")
