"""Key hashing and key-to-shard routing: the part of the contract every process must agree on.

All functions here are pure and fixed forever: changing one moves every key to another
row or shard. Any implementation (another language, another version) must reproduce
the test vectors in ``tests/unit/test_keys.py``.

* ``mix64(x)``: the splitmix64 finalizer (Steele, Lea & Flood, 2014) on 64 bits::

      x ^= x >> 30; x *= 0xBF58476D1CE4E5B9
      x ^= x >> 27; x *= 0x94D049BB133111EB
      x ^= x >> 31                                   (all arithmetic mod 2**64)

* ``jump_hash(key, n)``: jump consistent hash (Lamping & Veach, 2014). Growing a
  cluster from n to n+1 shards moves only about 1/(n+1) of the keys.
* ``shard_of(key, n) = jump_hash(mix64(key), n)``; ``misrouted(keys, n, shard)`` counts
  the keys that shard does not own (a shard checks every request with it).
* ``hash_feature(value, seed)``: raw feature values to keys. Bytes (``str`` is
  UTF-8 encoded first) are hashed with 64-bit FNV-1a whose offset basis is XORed with
  ``mix64(seed)``, then finalized with ``mix64``; integers with
  ``mix64(value ^ mix64(seed))`` on their two's-complement 64-bit pattern. The result
  is returned as a signed int64 (the wire type of keys). Byte strings are hashed by
  the numba kernel in ``protos.hashing`` (imported on first use), one implementation
  for single values and bulk readers alike.

Keys are int64 on the wire and in arrays but are treated as unsigned bit patterns.

Example:
    >>> shard_of(np.array([1, 2, 3], dtype=np.int64), 4).tolist()
    [0, 3, 0]
"""

from __future__ import annotations

from typing import overload

import numpy as np
import numpy.typing as npt

__all__ = ["hash_feature", "hash_features", "jump_hash", "misrouted", "mix64", "shard_of"]

_MASK64 = (1 << 64) - 1
_JUMP_MULT = 2862933555777941757


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


@overload
def mix64(x: int) -> int: ...
@overload
def mix64(x: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]: ...
def mix64(x: int | npt.NDArray[np.int64]) -> int | npt.NDArray[np.uint64]:
    """splitmix64 finalizer. An ``int`` gives an unsigned ``int`` in [0, 2**64);
    an int64/uint64 array gives a new uint64 array."""
    if isinstance(x, (int, np.integer)):
        i = int(x) & _MASK64
        i = ((i ^ (i >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        i = ((i ^ (i >> 27)) * 0x94D049BB133111EB) & _MASK64
        return i ^ (i >> 31)
    z: npt.NDArray[np.uint64] = np.asarray(x).astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def jump_hash(key: int, num_buckets: int) -> int:
    """Bucket in [0, num_buckets) of an unsigned 64-bit ``key`` (reference, one key)."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets}: must be >= 1")
    k = key & _MASK64
    b, j = -1, 0
    while j < num_buckets:
        b = j
        k = (k * _JUMP_MULT + 1) & _MASK64
        j = int((b + 1) * (float(1 << 31) / float((k >> 33) + 1)))
    return b


def _int64_bits(values: npt.ArrayLike, field: str) -> npt.NDArray[np.int64]:
    """Integers as int64 bit patterns (uint64 wraps); floats and other types raise ``TypeError``."""
    arr = np.asarray(values)
    if arr.dtype == object:
        # Python ints above 2**63 - 1 are unsigned 64-bit ids: keep their bits.
        try:
            arr = np.array([int(v) & _MASK64 for v in arr.reshape(-1)], dtype=np.uint64)
        except (TypeError, ValueError):
            raise TypeError(f"{field}: expected integers") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{field}: dtype {arr.dtype}, expected integers (floats would be truncated)")
    return np.ascontiguousarray(arr.reshape(-1)).astype(np.uint64, copy=False).view(np.int64)


def shard_of(keys: npt.ArrayLike, num_shards: int) -> npt.NDArray[np.int32]:
    """Shard index of every key: ``jump_hash(mix64(key), num_shards)``, vectorised.

    ``keys`` is any integer array (converted to int64 bit patterns); returns a new
    int32 array of the same length. Raises ``ValueError`` if ``num_shards < 1`` and
    ``TypeError`` for non-integer keys.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    k = _int64_bits(keys, "keys")
    out = np.zeros(k.shape[0], dtype=np.int32)
    if num_shards > 1:
        from protos.hashing import shard_buckets  # numba: loaded on the first multi-shard routing

        shard_buckets(k, num_shards, out)
    return out


def misrouted(keys: npt.NDArray[np.int64], num_shards: int, shard: int) -> tuple[int, int]:
    """(how many of ``keys`` shard ``shard`` of ``num_shards`` does not own, the index of the
    first of them or -1 when it owns them all): ``shard_of(keys, num_shards) != shard`` in
    one pass, without the array ``shard_of`` returns.

    ``keys`` is an int64 array (bit patterns, as decoded from the wire). Raises
    ``ValueError`` unless ``0 <= shard < num_shards``.

    Example:
        >>> misrouted(np.array([1, 2, 3], dtype=np.int64), 4, 0)
        (1, 1)
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard={shard}: not in [0, num_shards={num_shards})")
    if num_shards == 1 or keys.shape[0] == 0:
        return 0, -1
    from protos.hashing import count_misrouted  # numba: loaded on the first multi-shard check

    count, first = count_misrouted(keys, num_shards, shard)
    return int(count), int(first)


def hash_feature(value: str | bytes | int, seed: int) -> int:
    """64-bit key of one raw feature value for the table with ``seed`` (a signed int64).

    ``str`` values are UTF-8 encoded; ``int`` values use their 64-bit two's-complement
    pattern, so ``hash_feature(5, s) != hash_feature("5", s)``. Raises ``TypeError``
    for any other type.
    """
    if isinstance(value, str):
        value = value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        from protos.hashing import hash_strings  # numba: loaded on the first byte-string hash

        return int(hash_strings([bytes(value)], seed)[0])
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return _to_signed(mix64((int(value) & _MASK64) ^ mix64(seed & _MASK64)))
    raise TypeError(f"hash_feature: value of type {type(value).__name__}, expected str, bytes or int")


def hash_features(values: npt.ArrayLike, seed: int) -> npt.NDArray[np.int64]:
    """Vectorised ``hash_feature`` for an array of integer feature values."""
    v = _int64_bits(values, "values").view(np.uint64)
    mixed: npt.NDArray[np.uint64] = mix64((v ^ np.uint64(mix64(seed & _MASK64))).view(np.int64))
    return mixed.view(np.int64)
