"""A shard's memory budget: which rows leave RAM for the data dir, and when.

The budget compares the bytes every table holds in RAM (``Table.resident_bytes``) with
``limit_bytes``. Above ``HIGH_WATER`` of it, the evictor thread spills rows down to
``LOW_WATER``, in the background; a request that finds the budget itself exceeded spills
on its own thread (or waits for the evictor to finish) before it returns. Rows leave in
``eviction`` order ("lfu" or "lru", see ``ps.table.lifecycle``), ranked across every table at
once, so a large cold table gives up more rows than a small hot one.

A spill writes rows to storage. A failure there is recorded by the shard (``guard``)
and makes it read-only; the budget then waits, doing nothing, until the shard can
write again.

Example:
    >>> from ps.table import Table, TableSpec
    >>> item = Table(TableSpec("item", dim=8))
    >>> budget = MemoryBudget(0, tables=lambda: [item], guard=lambda fn, *a: fn(*a), writable=lambda: True)
    >>> budget.limit_bytes, budget.resident_bytes() == item.resident_bytes()
    (0, True)
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ps.shard.background import EVICTOR, LoopHealth
from ps.store import StorageFailed
from ps.table import EVICTIONS, Eviction, Table, now_tick

__all__ = ["HIGH_WATER", "LOW_WATER", "MemoryBudget", "check_budget"]


def check_budget(memory_budget_bytes: int, has_data_dir: bool) -> None:
    """Raise ``ValueError`` unless a shard may have ``memory_budget_bytes`` (0: no limit):
    a budget needs a data dir, where the rows over it go."""
    if memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes}: must be >= 0 (0: no limit)")
    if memory_budget_bytes and not has_data_dir:
        raise ValueError("memory_budget_bytes needs data_dir: rows over the budget are moved to RocksDB there")


# Above HIGH_WATER of the budget the evictor thread spills rows down to LOW_WATER.
HIGH_WATER = 0.97
LOW_WATER = 0.92


class MemoryBudget:
    """Keeps the tables ``tables()`` returns within ``limit_bytes`` of RAM (0: no limit).
    Thread-safe: one spill runs at a time, others wait and then see what is left.

    ``guard(fn, *args)`` runs a storage write and records its failure; ``writable()``
    says whether the shard takes writes now (a spill is a write).
    """

    def __init__(
        self,
        limit_bytes: int,
        eviction: Eviction = "lfu",
        *,
        tables: Callable[[], Sequence[Table]],
        guard: Callable[..., Any],
        writable: Callable[[], bool],
    ) -> None:
        if limit_bytes < 0:
            raise ValueError(f"memory_budget_bytes={limit_bytes}: must be >= 0 (0: no limit)")
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction={eviction!r}: expected one of {', '.join(EVICTIONS)}")
        self.limit_bytes = limit_bytes
        self.eviction: Eviction = eviction
        self._tables = tables
        self._guard = guard
        self._writable = writable
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def resident_bytes(self) -> int:
        """What the budget is compared with: every table's ``resident_bytes``."""
        return sum(t.resident_bytes() for t in self._tables())

    def after_request(self) -> None:
        """Wake the evictor as the tables near the budget; spill here, or wait for the
        evictor, beyond it. Never raises ``StorageFailed``: the request it follows was
        applied (and must be acknowledged); a spill that fails turns the shard read-only
        for the next ones."""
        if not (self.limit_bytes and self._writable()):
            return
        used = self.resident_bytes()
        if used > self.limit_bytes:
            with contextlib.suppress(StorageFailed):  # recorded by guard
                self.enforce()
        elif used > HIGH_WATER * self.limit_bytes and self._thread is not None:
            self._wake.set()

    def enforce(self) -> int:
        """Spill rows in ``eviction`` order, across tables, down to ``LOW_WATER`` of the
        budget; returns rows moved."""
        with self._lock:
            # A table without a disk (``ps.replication.follow.held_as``: converted to --serve-dtype) stays whole.
            tables = [t for t in self._tables() if t.evictable]
            need = self.resident_bytes() - int(LOW_WATER * self.limit_bytes)
            if need <= 0 or not tables or not self._writable():
                return 0
            now = now_tick()
            scans = [t.eviction_scan(now, self.eviction) for t in tables]
            weights = [t.bytes_per_row for t in tables]
            by_rank = sum((s.hist * w for s, w in zip(scans, weights, strict=True)), np.zeros_like(scans[0].hist))
            from_top = np.cumsum(by_rank[::-1])
            j = min(int(np.searchsorted(from_top, need)), by_rank.shape[0] - 1)
            cutoff = by_rank.shape[0] - 1 - j  # evict every row ranked above this ...
            above = int(from_top[j - 1]) if j > 0 else 0
            share = (need - above) / by_rank[cutoff] if by_rank[cutoff] else 0.0  # ... and this share of it
            moved = 0
            for t, scan in zip(tables, scans, strict=True):
                h = scan.hist
                count = int(h[cutoff + 1 :].sum()) + math.ceil(h[cutoff] * min(1.0, share))
                if count:  # ranks only fall meanwhile (rows used again): the scan bounds the victims
                    moved += self._guard(t.evict, count, now, scan, self.eviction)
            return moved

    def start(self, health: LoopHealth, name: str) -> None:
        """Start the evictor thread (named ``name``) if there is a budget; each run of it
        reports to ``health``."""
        if self._thread is None and self.limit_bytes:
            self._thread = threading.Thread(target=self._evict_loop, args=(health,), name=name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the evictor thread, waiting up to ``timeout_s`` for a spill under way."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _evict_loop(self, health: LoopHealth) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            if self._stop.is_set() or not self._writable():
                continue
            with health.run(EVICTOR):
                if self.resident_bytes() > HIGH_WATER * self.limit_bytes:
                    self.enforce()
