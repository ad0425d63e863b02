"""Batch preparation without a Python object per key: dedup, group by shard, merge back.

The kernels are numba-compiled (released GIL). The plan for one table's keys:

1. ``dedup``: unique keys in first-seen order and, per input position, the index of
   its unique key (``inverse``), so only one row per distinct key crosses the wire;
2. ``group``: the unique keys ordered shard by shard (``order``) with the slice
   bounds of each shard (``bounds``), so one request per shard carries its keys;
3. ``fill_rows``: each shard's answer rows copied to every input position that asked
   for them, in the caller's order (``slots`` of the plan say where each one is).

Example:
    >>> unique, inverse = dedup(np.array([5, 7, 5]))
    >>> unique.tolist(), inverse.tolist()
    ([5, 7], [0, 1, 0])
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from protos.hashing import shard_buckets

__all__ = ["dedup", "fill_rows", "group", "plan_keys", "scatter_rows", "sum_duplicates"]


@numba.njit(nogil=True, cache=True)
def _dedup(
    keys: npt.NDArray[np.int64],
    table_keys: npt.NDArray[np.int64],
    table_ids: npt.NDArray[np.int64],
    unique: npt.NDArray[np.int64],
    inverse: npt.NDArray[np.int64],
) -> int:
    mask = table_ids.shape[0] - 1
    m = 0
    for i in range(keys.shape[0]):
        key = keys[i]
        z = np.uint64(key) ^ np.uint64(0x632BE59BD9B4E019)
        z = (z ^ (z >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
        z = z ^ (z >> np.uint64(29))
        pos = np.int64(z & np.uint64(mask))
        while True:
            uid = table_ids[pos]
            if uid < 0:
                table_ids[pos] = m
                table_keys[pos] = key
                unique[m] = key
                inverse[i] = m
                m += 1
                break
            if table_keys[pos] == key:
                inverse[i] = uid
                break
            pos = (pos + 1) & mask
    return m


def dedup(keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(unique, inverse)`` with ``unique[inverse] == keys``; unique keys keep first-seen order."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    unique, inverse = np.empty_like(keys), np.empty_like(keys)
    m = _dedup(keys, *_hash_table(keys.shape[0]), unique, inverse)
    return unique[:m], inverse


def _hash_table(n: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Empty ``(table_keys, table_ids)`` of ``_dedup`` for ``n`` keys (load factor <= 0.5)."""
    size = 1 << max(4, int(2 * n - 1).bit_length())
    return np.empty(size, dtype=np.int64), np.full(size, -1, dtype=np.int64)


@numba.njit(nogil=True, cache=True)
def _counting_sort(
    shards: npt.NDArray[np.int32], num_shards: int, order: npt.NDArray[np.int64], bounds: npt.NDArray[np.int64]
) -> None:
    for i in range(shards.shape[0]):
        bounds[shards[i] + 1] += 1
    for s in range(num_shards):
        bounds[s + 1] += bounds[s]
    fill = bounds[:-1].copy()
    for i in range(shards.shape[0]):
        s = shards[i]
        order[fill[s]] = i
        fill[s] += 1


def group(shards: npt.NDArray[np.int32], num_shards: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(order, bounds)``: ``order[bounds[s]:bounds[s+1]]`` are the positions routed to shard ``s``
    (stable, so each shard sees keys in first-seen order)."""
    order = np.empty(shards.shape[0], dtype=np.int64)
    bounds = np.zeros(num_shards + 1, dtype=np.int64)
    _counting_sort(np.ascontiguousarray(shards, dtype=np.int32), num_shards, order, bounds)
    return order, bounds


@numba.njit(nogil=True, cache=True)
def _plan(
    keys: npt.NDArray[np.int64],
    num_shards: int,
    table_keys: npt.NDArray[np.int64],
    table_ids: npt.NDArray[np.int64],
    unique: npt.NDArray[np.int64],
    inverse: npt.NDArray[np.int64],
    shards: npt.NDArray[np.int32],
    order: npt.NDArray[np.int64],
    bounds: npt.NDArray[np.int64],
    slots: npt.NDArray[np.int64],
) -> int:
    m = _dedup(keys, table_keys, table_ids, unique, inverse)
    if num_shards > 1:
        shard_buckets(unique[:m], num_shards, shards[:m])
    _counting_sort(shards[:m], num_shards, order[:m], bounds)
    rank = table_keys  # free again: where each unique key stands in the routed order
    for k in range(m):
        rank[order[k]] = k
    for i in range(keys.shape[0]):
        slots[i] = rank[inverse[i]]
    return m


def plan_keys(keys: npt.NDArray[np.int64], num_shards: int) -> tuple[npt.NDArray[np.int64], ...]:
    """``dedup`` then ``group(shard_of(unique))`` in one compiled call: ``(unique, inverse,
    order, bounds, slots)``, where ``slots[i]`` is the place of ``keys[i]``'s unique key in
    the routed order (``order[slots[i]] == inverse[i]``): answers, concatenated shard by
    shard, hold ``keys[i]``'s row at ``slots[i]``. A lookup of a few thousand keys spends
    more on each call from Python than on its keys, so the steps share one."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    n = keys.shape[0]
    unique, inverse, order, slots = (np.empty_like(keys) for _ in range(4))
    bounds = np.zeros(num_shards + 1, dtype=np.int64)
    m = _plan(keys, num_shards, *_hash_table(n), unique, inverse, np.zeros(n, dtype=np.int32), order, bounds, slots)
    return unique[:m], inverse, order[:m], bounds, slots


@numba.njit(nogil=True, cache=True)
def _scatter(
    out: npt.NDArray[np.float32],
    rows: npt.NDArray[np.float32],
    positions: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
) -> None:
    dim = out.shape[1]
    for i in range(positions.shape[0]):
        p = positions[i]
        r = src[i]
        for j in range(dim):
            out[p, j] = rows[r, j]


def scatter_rows(
    out: npt.NDArray[np.float32],
    rows: npt.NDArray[np.float32],
    positions: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
) -> None:
    """``out[positions[i]] = rows[src[i]]`` for every i (rows may be a read-only view)."""
    _scatter(out, rows, positions, src)


@numba.njit(nogil=True, cache=True)
def _fill(
    out: npt.NDArray[np.float32], rows: npt.NDArray[np.float32], slots: npt.NDArray[np.int64], start: int
) -> None:
    dim, n = out.shape[1], rows.shape[0]
    for i in range(slots.shape[0]):
        r = slots[i] - start
        if 0 <= r < n:
            for j in range(dim):
                out[i, j] = rows[r, j]


def fill_rows(
    out: npt.NDArray[np.float32], rows: npt.NDArray[np.float32], slots: npt.NDArray[np.int64], start: int
) -> None:
    """``out[i] = rows[slots[i] - start]`` for every i whose slot falls in ``rows``: one
    answer's rows (routed-order places ``start..start+len(rows)``) copied to every input
    position that asked for them, duplicates included (rows may be a read-only view)."""
    _fill(out, rows, slots, start)


@numba.njit(nogil=True, cache=True)
def _segment_sum(grads: npt.NDArray[np.float32], inverse: npt.NDArray[np.int64], out: npt.NDArray[np.float32]) -> None:
    dim = grads.shape[1]
    for i in range(inverse.shape[0]):
        u = inverse[i]
        for j in range(dim):
            out[u, j] += grads[i, j]


def sum_duplicates(
    grads: npt.NDArray[np.float32], inverse: npt.NDArray[np.int64], num_unique: int
) -> npt.NDArray[np.float32]:
    """Per unique key, the sum of its rows of ``grads`` (in input order, float32)."""
    out = np.zeros((num_unique, grads.shape[1]), dtype=np.float32)
    _segment_sum(np.ascontiguousarray(grads, dtype=np.float32), inverse, out)
    return out
