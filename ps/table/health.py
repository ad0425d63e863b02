"""Embedding health of one table: what its rows are doing, measured without a scan per request.

* **Pushes, sampled.** Each push reads up to ``SAMPLE_PER_PUSH`` of the rows it updates
  (evenly spread over them) before and after the optimizer runs: the L2 norm of each row
  after the push, and of what the push changed in it, go into log-spaced histograms; a
  sampled row holding NaN or Inf is counted. A push pays two gathers of at most 16 rows
  and a few small numpy calls; a lookup pays nothing.
* **Resident rows, scanned once a window.** ``scan`` (the shard's maintenance thread runs
  it every health window) passes once over the resident rows' last-access times, outside
  the table lock as eviction's scan does: the rows looked up or pushed within the window,
  and every resident row by its idle time (seconds since its last lookup or push).

Histograms count since the table was opened (Prometheus takes rates of them); each also
keeps the counts of the latest complete window (``recent``), which ``Stats`` reads for
its quantiles.

Example:
    >>> h = LogHistogram(np.array([1.0, 2.0, 4.0]))
    >>> h.add(np.array([0.5, 1.5, 3.0, 9.0]))
    >>> h.counts.tolist(), h.quantile(0.5)
    ([1, 1, 1, 1], 2.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from ps.table.lifecycle import TICKS_PER_S

__all__ = ["IDLE_BOUNDS_S", "SAMPLE_PER_PUSH", "LogHistogram", "ScanResult", "TableHealth", "bucket_quantile"]

SAMPLE_PER_PUSH = 16
ROW_NORM_BOUNDS = 2.0 ** np.arange(-10, 11, dtype=np.float64)  # 0.001 .. 1024
UPDATE_NORM_BOUNDS = 2.0 ** np.arange(-24, 1, dtype=np.float64)  # 6e-8 .. 1
IDLE_BOUNDS_S = np.array([1, 10, 60, 300, 900, 3600, 6 * 3600, 86400, 7 * 86400, 30 * 86400], dtype=np.float64)


@dataclass
class LogHistogram:
    """Counts of values by bucket: bucket ``i`` holds values in ``(bounds[i-1], bounds[i]]``,
    the last one those above ``bounds[-1]`` (Prometheus's ``le`` buckets, not cumulative).
    NaN and Inf are not counted (``TableHealth`` counts them apart)."""

    bounds: npt.NDArray[np.float64]
    counts: npt.NDArray[np.int64] = field(init=False)
    total: float = 0.0  # sum of the values counted
    recent: npt.NDArray[np.int64] = field(init=False)  # counts of the latest complete window
    _mark: npt.NDArray[np.int64] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.bounds.shape[0] + 1, np.int64)
        self.recent = self.counts.copy()
        self._mark = self.counts.copy()

    def add(self, values: npt.NDArray[Any]) -> None:
        v = values[np.isfinite(values)]
        if v.shape[0]:
            self.counts += np.bincount(np.searchsorted(self.bounds, v), minlength=self.counts.shape[0])
            self.total += float(v.sum())

    def rotate(self) -> None:
        """End a window: ``recent`` becomes what was counted since the last ``rotate``."""
        self.recent, self._mark = self.counts - self._mark, self.counts.copy()

    def quantile(self, q: float, counts: npt.NDArray[np.int64] | None = None) -> float:
        """``bucket_quantile`` of ``counts`` (default: all counted)."""
        return bucket_quantile(self.bounds, self.counts if counts is None else counts, q)


def bucket_quantile(
    bounds: Sequence[float] | npt.NDArray[Any], counts: Sequence[int] | npt.NDArray[Any], q: float
) -> float:
    """The upper bound of the bucket holding the ``q`` quantile of values counted by bucket
    (``LogHistogram``'s buckets); ``inf`` above the last bound, ``nan`` with nothing counted."""
    cumulative = np.cumsum(np.asarray(counts, np.int64))
    if not cumulative.shape[0] or cumulative[-1] == 0:
        return math.nan
    i = int(np.searchsorted(cumulative, max(1, math.ceil(q * int(cumulative[-1])))))
    return float(bounds[i]) if i < len(bounds) else math.inf


@dataclass(frozen=True)
class ScanResult:
    """What one scan of the resident rows found."""

    unix_s: float  # when it ran
    window_s: float
    touched: int  # resident rows looked up or pushed within ``window_s`` before it
    idle: npt.NDArray[np.int64]  # resident rows by idle seconds, bucketed by ``IDLE_BOUNDS_S``


class TableHealth:
    """The health figures of one table (see the module). Not thread-safe: the table calls
    ``before_push``/``after_push`` under its lock; ``scan`` and the readers run in the
    maintenance thread and in ``Stats``, where a figure a push is changing may be read
    half-updated (a count off by one sample), never wrong for long."""

    def __init__(self) -> None:
        self.row_norm = LogHistogram(ROW_NORM_BOUNDS)
        self.update_norm = LogHistogram(UPDATE_NORM_BOUNDS)
        self.nonfinite_rows = 0
        self.latest: ScanResult | None = None

    def sample(self, slots: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        """The slots of a push to read: at most ``SAMPLE_PER_PUSH``, evenly spread."""
        n = slots.shape[0]
        return slots if n <= SAMPLE_PER_PUSH else slots[:: -(-n // SAMPLE_PER_PUSH)]

    def pushed(self, before: npt.NDArray[np.float32], after: npt.NDArray[np.float32]) -> None:
        """Count sampled rows as they were ``before`` a push and are ``after`` it."""
        if not before.shape[0]:
            return
        norms = np.sqrt(np.einsum("ij,ij->i", after, after, dtype=np.float64))
        change = after - before
        self.row_norm.add(norms)
        self.update_norm.add(np.sqrt(np.einsum("ij,ij->i", change, change, dtype=np.float64)))
        self.nonfinite_rows += int((~np.isfinite(norms)).sum())

    def scan(
        self,
        slots: npt.NDArray[np.int32],
        last_access: npt.NDArray[np.uint32],
        now: np.uint32,
        unix_s: float,
        window_s: float,
    ) -> ScanResult:
        """Scan the index's ``slots`` (``-1``: an empty bucket) and the arena's ``last_access``
        (ticks) at ``now``; ends the histograms' window. Keeps and returns the result."""
        bounds = np.round(IDLE_BOUNDS_S * TICKS_PER_S).astype(np.int64)
        idle = np.zeros(bounds.shape[0] + 1, np.int64)
        touched = _scan(slots, last_access, np.int64(now), bounds, np.int64(round(window_s * TICKS_PER_S)), idle)
        self.row_norm.rotate()
        self.update_norm.rotate()
        self.latest = ScanResult(unix_s, window_s, int(touched), idle)
        return self.latest


@numba.njit(nogil=True, cache=True)
def _scan(
    slots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    now: np.int64,
    bounds: npt.NDArray[np.int64],
    window: np.int64,
    idle: npt.NDArray[np.int64],
) -> np.int64:
    """Count resident rows by idle ticks into ``idle``; returns those idle for at most ``window``."""
    touched = np.int64(0)
    limit = last_access.shape[0]
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0 or s >= limit:  # an empty bucket, or a slot of an arena grown since
            continue
        ticks = (now - np.int64(last_access[s])) & np.int64(0xFFFFFFFF)  # the clock is 32 bits
        if ticks <= window:
            touched += 1
        b = 0
        while b < bounds.shape[0] and ticks > bounds[b]:
            b += 1
        idle[b] += 1
    return touched
