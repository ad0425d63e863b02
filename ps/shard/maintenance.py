"""A shard's maintenance thread: interval flushes, TTL sweeps, storage recovery, rates, health.

Every 0.25 s the thread samples each table's spill, fault-in and row-creation totals
into ``rates``, and every ``health_window_s`` it scans each table's resident rows for
their health (``Table.scan_health``), on every shard.
While the data dir refuses writes it does nothing else but retry recovery, with the
backoff ``StorageHealth`` keeps; once writes succeed again, the flush and the sweep
run at once. Otherwise it flushes dirty rows every ``flush_interval_s`` (``interval``
durability) and applies TTLs as often as the shortest TTL needs (a quarter of it,
between 0.5 s and 60 s), on training shards only. Each run reports to ``health``.

Example:
    >>> from ps.shard.background import LoopHealth, RateWindow
    >>> from ps.shard.recovery import StorageHealth
    >>> loop = Maintenance(
    ...     "ps-shard0-maint", tables=list, rates=RateWindow(), health=LoopHealth(),
    ...     storage=StorageHealth(0), recover=lambda: None, flush=lambda: 0, expire=lambda: 0,
    ...     sweep_ttls=lambda: True, flush_interval_s=None,
    ... )
    >>> loop.start(); loop.stop()
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

from ps.shard.background import INTERVAL_FLUSH, STORAGE_RECOVERY, TTL_SWEEP, LoopHealth, RateWindow
from ps.shard.recovery import StorageHealth
from ps.table import Table

__all__ = ["Maintenance"]

_TICK_S = 0.25


class Maintenance:
    """The thread that runs a shard's periodic work (see the module docstring).

    ``recover()`` tries to make failed storage writable (raising ``StorageFailed`` if
    it cannot); ``flush()`` writes dirty rows; ``expire()`` applies TTLs;
    ``sweep_ttls()`` says whether TTLs may run now; ``flush_interval_s``: None when
    nothing is flushed on a timer (no data dir, or another durability mode);
    ``health_window_s``: how often tables are scanned for their health (0: never).
    """

    def __init__(
        self,
        name: str,
        *,
        tables: Callable[[], Sequence[Table]],
        rates: RateWindow,
        health: LoopHealth,
        storage: StorageHealth | None,
        recover: Callable[[], None],
        flush: Callable[[], int],
        expire: Callable[[], int],
        sweep_ttls: Callable[[], bool],
        flush_interval_s: float | None,
        health_window_s: float = 0.0,
    ) -> None:
        self._name = name
        self._tables = tables
        self._rates = rates
        self._health = health
        self._storage = storage
        self._recover = recover
        self._flush = flush
        self._expire = expire
        self._sweep_ttls = sweep_ttls
        self._flush_interval_s = flush_interval_s
        self._health_window_s = health_window_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread, waiting up to ``timeout_s`` for a run under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        last_flush = last_ttl = last_scan = time.monotonic()
        while not self._stop.wait(_TICK_S):
            now = time.monotonic()
            tables = self._tables()
            self._rates.sample(
                now,
                {
                    t.spec.name: (t.counters.rows_spilled, t.counters.rows_faulted_in, t.counters.rows_created)
                    for t in tables
                },
            )
            if self._health_window_s and now - last_scan >= self._health_window_s:
                last_scan = now
                for t in tables:
                    t.scan_health(self._health_window_s)
            if self._storage is not None and not self._storage.writable:
                if self._storage.retry_due(now):
                    with self._health.run(STORAGE_RECOVERY):
                        self._recover()
                    if self._storage.writable:  # run the other loops now: a failure of theirs clears at once
                        last_flush = last_ttl = -math.inf
                continue
            if self._flush_interval_s is not None and now - last_flush >= self._flush_interval_s:
                last_flush = now
                with self._health.run(INTERVAL_FLUSH):
                    self._flush()
            ttls = [t.spec.lifecycle.ttl_seconds for t in tables if t.spec.lifecycle.ttl_seconds]
            if ttls and now - last_ttl >= max(0.5, min(60.0, min(ttls) / 4)) and self._sweep_ttls():
                last_ttl = now
                with self._health.run(TTL_SWEEP):
                    self._expire()
