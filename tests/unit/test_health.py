"""Embedding health of a table (``ps.table.health``): push samples, the resident-row scan,
and what ``Stats`` and the metrics make of them."""

from __future__ import annotations

import math

import numpy as np
from prometheus_client import generate_latest

from ps.service.metrics import shard_registry
from ps.service.report import shard_stats
from ps.shard import Shard
from ps.table import Table, TableSpec
from ps.table.health import SAMPLE_PER_PUSH, LogHistogram
from ps.table.lifecycle import TICKS_PER_S, now_tick
from ps.table.optimizers import OptimizerKind, OptimizerParams


def test_histogram_buckets_are_prometheus_le_buckets_and_windows_rotate() -> None:
    h = LogHistogram(np.array([1.0, 2.0, 4.0]))
    h.add(np.array([1.0, 2.0, 2.5, 100.0, np.nan, np.inf]))  # a bound belongs to its own bucket
    assert h.counts.tolist() == [1, 1, 1, 1]
    assert h.total == 105.5
    h.rotate()
    h.add(np.array([3.0, 3.5]))
    h.rotate()
    assert h.recent.tolist() == [0, 0, 2, 0] and h.counts.tolist() == [1, 1, 3, 1]
    assert h.quantile(0.5, h.recent) == 4.0 and h.quantile(0.99) == math.inf
    assert math.isnan(LogHistogram(np.array([1.0])).quantile(0.5))


def test_a_push_samples_at_most_16_rows_with_their_norms_and_changes() -> None:
    t = Table(TableSpec("t", dim=4, seed=1, optimizer=OptimizerParams(kind=OptimizerKind.SGD, lr=1.0)))
    keys = np.arange(1000, dtype=np.int64)
    before = t.lookup(keys)
    grads = np.full((1000, 4), 0.3, np.float32)  # each row moves by -0.3 per element: |change| = 0.6
    t.push(keys, grads, client_id="c", seq=1)
    h = t.health
    assert h is not None
    assert h.update_norm.counts.sum() == SAMPLE_PER_PUSH
    assert h.update_norm.quantile(0.0) == h.update_norm.quantile(1.0) == 1.0  # the (0.5, 1] bucket
    after_norms = np.linalg.norm(before - np.float32(0.3), axis=1)
    expected = LogHistogram(h.row_norm.bounds)
    expected.add(after_norms[:: -(-1000 // SAMPLE_PER_PUSH)])
    assert h.row_norm.counts.tolist() == expected.counts.tolist()
    assert h.nonfinite_rows == 0


def test_rows_an_overflowing_update_makes_infinite_are_counted() -> None:
    t = Table(TableSpec("t", dim=2, seed=1, optimizer=OptimizerParams(kind=OptimizerKind.SGD, lr=1e38)))
    keys = np.arange(8, dtype=np.int64)
    t.push(keys, np.full((8, 2), 1e10, np.float32), client_id="c", seq=1)  # finite gradients, infinite rows
    assert t.health is not None and t.health.nonfinite_rows == 8
    assert t.health.row_norm.counts.sum() == 0  # not in the histogram: counted apart


def test_the_scan_counts_rows_touched_in_the_window_and_buckets_idle_times() -> None:
    t = Table(TableSpec("t", dim=2, seed=1))
    t.lookup(np.arange(10, dtype=np.int64))
    now = now_tick()
    # Ten resident rows; make three of them idle for two minutes, one for two hours.
    slots = t._ram.slots(np.arange(10, dtype=np.int64))
    last = t._ram.arena.last_access
    last[slots[:3]] = now - np.uint32(120 * TICKS_PER_S)
    last[slots[3]] = now - np.uint32(7200 * TICKS_PER_S)
    scan = t.scan_health(window_s=60.0)
    assert scan is not None
    assert scan.touched == 6
    # Bounds 1, 10, 60, 300, 900, 3600, 6 h, ...: six rows <= 1 s, three <= 300 s, one <= 6 h.
    assert scan.idle.tolist() == [6, 0, 0, 3, 0, 0, 1, 0, 0, 0, 0]


def test_health_off_samples_nothing_and_stats_say_so() -> None:
    shard = Shard(0, 1, health_window_s=0)
    try:
        shard.install_table(TableSpec("t", dim=2, seed=1))
        (table,) = shard.tables()
        assert table.health is None and table.scan_health(60.0) is None
        (stats,) = shard_stats(shard).tables
        assert stats.health_window_s == 0 and not stats.HasField("row_norm")
    finally:
        shard.close()


def test_stats_and_metrics_carry_the_health_figures() -> None:
    shard = Shard(0, 1)
    try:
        shard.install_table(TableSpec("t", dim=4, seed=1))
        (table,) = shard.tables()
        keys = np.arange(100, dtype=np.int64)
        table.lookup(keys)
        table.push(keys, np.ones((100, 4), np.float32), client_id="c", seq=1)
        table.scan_health(60.0)
        (stats,) = shard_stats(shard).tables
        assert stats.rows_touched == 100 and stats.health_window_s == 60.0
        assert sum(stats.row_norm.counts) == sum(stats.row_norm.recent) == 15  # 100 rows, every 7th
        assert list(stats.row_idle_s.counts)[0] == 100
        text = generate_latest(shard_registry(shard)).decode()
        assert 'ps_table_row_norm_count{table="t"} 15.0' in text
        assert 'ps_table_rows_touched{table="t"} 100.0' in text
        assert 'ps_table_row_idle_seconds{quantile="0.5",table="t"} 1.0' in text
        assert 'ps_table_nonfinite_rows_total{table="t"} 0.0' in text
    finally:
        shard.close()
