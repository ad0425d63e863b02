"""The byte-string half of ``hash_feature``, as one numba kernel every reader shares.

``protos.keys.hash_feature`` defines the hash; this module computes its byte-string
case for many values at once, without a Python object per value: the values lie in
one ``uint8`` buffer and each is a ``[start, end)`` range of it. The click-log reader
(``worker.data``) and the predictor both call ``hash_fields``, and
``hash_feature`` itself hashes bytes through it, so the hash exists once.

This module imports numba, so ``import protos`` does not load it; ``protos.keys``
imports it on the first byte-string hash.

Example:
    >>> from protos.keys import hash_feature
    >>> hash_strings(["a", b""], 7).tolist() == [hash_feature("a", 7), hash_feature(b"", 7)]
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["count_misrouted", "fnv_basis", "hash_fields", "hash_strings", "mix64_step", "shard_buckets"]

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = np.uint64(0x100000001B3)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # the splitmix64 finalizer's constants, as in protos.keys.mix64
_MIX2 = np.uint64(0x94D049BB133111EB)
_JUMP = np.uint64(2862933555777941757)  # jump hash's linear congruential step

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
U8 = npt.NDArray[np.uint8]


@numba.njit(nogil=True, cache=True, inline="always")
def mix64_step(z: np.uint64) -> np.uint64:
    """``protos.keys.mix64`` of one uint64, inside numba kernels: the one compiled copy of
    the splitmix64 finalizer that the key hashes, shard routing, row initializers, the key
    index and the admission sketch all call."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def fnv_basis(seed: int) -> int:
    """FNV-1a offset basis of the table with ``seed``: ``0xCBF29CE484222325 ^ mix64(seed)``."""
    return _FNV_OFFSET ^ int(mix64_step(np.uint64(seed & 0xFFFFFFFFFFFFFFFF)))


@numba.njit(nogil=True, cache=True)
def hash_fields(buf: U8, starts: I64, ends: I64, cols: I64, bases: U64, out: U64) -> None:
    """``out[c, i]`` = key of the bytes ``buf[starts[i, cols[c]]:ends[i, cols[c]]]`` under ``bases[c]``.

    ``starts``/``ends`` are ``[rows, fields]`` int64 ranges into ``buf``; ``cols`` picks the
    fields to hash and ``bases`` holds each one's ``fnv_basis(seed)``. Keys are written as
    uint64 bit patterns (view the result as int64). Releases the GIL.
    """
    for c in range(cols.shape[0]):
        col, basis = cols[c], bases[c]
        for i in range(starts.shape[0]):
            h = basis
            for p in range(starts[i, col], ends[i, col]):
                h = (h ^ np.uint64(buf[p])) * _FNV_PRIME
            out[c, i] = mix64_step(h)


@numba.njit(nogil=True, cache=True, inline="always")
def _jump(key: np.int64, num_buckets: int, steps: int) -> int:
    """``jump_hash(mix64(key), num_buckets)``. The first ``steps`` rounds of jump hash's loop
    run unconditionally and keep their result by selection rather than by branching: the
    loop ends after a data-dependent number of rounds, and a branch on it mispredicts about
    every other key (2.5x slower at 2 buckets). Rare keys that need more rounds finish in
    the plain loop."""
    k = mix64_step(np.uint64(key))
    b, j = -1, 0
    for _ in range(steps):
        active = j < num_buckets
        k_next = k * _JUMP + np.uint64(1)
        j_next = int((j + 1) * (float(1 << 31) / float((k_next >> np.uint64(33)) + np.uint64(1))))
        b = j if active else b
        k = k_next if active else k
        j = j_next if active else j
    while j < num_buckets:
        b = j
        k = k * _JUMP + np.uint64(1)
        j = int((b + 1) * (float(1 << 31) / float((k >> np.uint64(33)) + np.uint64(1))))
    return b


@numba.njit(nogil=True, cache=True)
def shard_buckets(keys: I64, num_buckets: int, out: npt.NDArray[np.int32]) -> None:
    """``out[i] = jump_hash(mix64(keys[i]), num_buckets)``: ``shard_of`` in one pass over the
    keys (the numpy form of mix64 makes five passes and three temporaries)."""
    steps = int(np.log(num_buckets)) + 2  # jump hash takes about ln(n) + 1 rounds
    for i in range(keys.shape[0]):
        out[i] = _jump(keys[i], num_buckets, steps)


@numba.njit(nogil=True, cache=True)
def count_misrouted(keys: I64, num_buckets: int, bucket: int) -> tuple[int, int]:
    """(how many keys have ``jump_hash(mix64(key), num_buckets) != bucket``, the index of the
    first of them or -1): a shard's ownership check, in one pass that writes nothing."""
    steps = int(np.log(num_buckets)) + 2
    count, first = 0, -1
    for i in range(keys.shape[0]):
        if _jump(keys[i], num_buckets, steps) != bucket:
            if first < 0:
                first = i
            count += 1
    return count, first


def hash_strings(values: Sequence[str | bytes], seed: int) -> I64:
    """``[hash_feature(v, seed) for v in values]`` for ``str`` (UTF-8) and ``bytes`` values.

    Encodes each value in Python, so it suits small inputs and tests; bulk callers hand
    ``hash_fields`` their buffer directly. Returns a new int64 array.
    """
    raw = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
    lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = np.empty((1, len(raw)), dtype=np.uint64)
    buf = np.frombuffer(b"".join(raw) or b"\0", dtype=np.uint8)
    bases = np.array([fnv_basis(seed)], dtype=np.uint64)
    hash_fields(buf, starts[:, None], ends[:, None], np.zeros(1, np.int64), bases, out)
    keys: I64 = out[0].view(np.int64)
    return keys
