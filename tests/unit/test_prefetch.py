"""The prefetch hints compile for every array the kernels hand them and change no result."""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt
import pytest

from ps.table.keyindex import _AHEAD, KeyIndex
from ps.table.prefetch import prefetch, prefetch_at, prefetch_row


@numba.njit(cache=False)
def _sum_rows(values: npt.NDArray[np.float32], rows: npt.NDArray[np.int64], ahead: int) -> float:
    total = 0.0
    for k in range(rows.size):
        if k + ahead < rows.size:
            prefetch_row(values, rows[k + ahead])
            prefetch(rows, k + ahead)
            prefetch_at(values, rows[k + ahead], values.shape[1] - 1)
        for j in range(values.shape[1]):
            total += values[rows[k], j]
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint16])
@pytest.mark.parametrize("dim", [1, 3, 16, 64, 100])
def test_a_kernel_reads_the_same_with_prefetch_hints(dtype: type, dim: int) -> None:
    rng = np.random.default_rng(dim)
    values = rng.integers(0, 100, size=(257, dim)).astype(dtype)
    rows = rng.integers(0, 257, size=1000)
    expected = float(values[rows].astype(np.float64).sum())
    assert _sum_rows(values, rows, 0) == pytest.approx(expected)
    assert _sum_rows(values, rows, 8) == pytest.approx(expected)


@pytest.mark.parametrize("n", [0, 1, _AHEAD - 1, _AHEAD, _AHEAD + 1, 5 * _AHEAD + 3])
def test_probes_that_prefetch_ahead_find_every_key_and_no_other(n: int) -> None:
    rng = np.random.default_rng(n)
    stored = rng.integers(-(1 << 62), 1 << 62, size=3 * n + 5)
    index = KeyIndex()
    slots, _ = index.lookup_or_insert(stored)
    absent = rng.integers(-(1 << 62), 1 << 62, size=n)
    queries = np.concatenate([stored[: n // 2], absent, stored[n // 2 : n]])
    got = index.lookup(queries)
    where = {int(k): int(s) for k, s in zip(stored, slots)}
    assert got.tolist() == [where.get(int(k), -1) for k in queries]
