"""Prometheus metrics of a shard (``ps-server --metrics-port``).

RPC metrics (latency, codes, in flight, refusals) come from ``protos.rpc.guard.RpcMetrics``;
everything else is read from the shard's own counters when Prometheus scrapes
(``ShardCollector``), so serving a call costs no metric update beyond the RPC's. Names
start with ``ps_``, carry their unit, and are labelled by table at most, never by key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from protos import ps_pb2 as pb
from ps.service.report import shard_stats
from ps.shard import Shard
from ps.table import bucket_quantile

__all__ = ["ShardCollector", "shard_registry"]

# Running totals per table: (field of TableStats, metric name without ps_table_ and _total, help).
_TABLE_TOTALS = (
    ("lookups", "keys_looked_up", "Keys looked up"),
    ("pushes", "keys_pushed", "Keys whose gradients were applied"),
    ("rows_created", "rows_created", "Rows created (a lookup or push of a new key)"),
    ("ram_hits", "ram_hits", "Looked-up keys whose row was in RAM"),
    ("ram_misses", "ram_misses", "Looked-up keys whose row was read back from disk"),
    ("rows_spilled", "rows_spilled", "Rows moved from RAM to disk"),
    ("rows_faulted_in", "rows_faulted_in", "Rows read back from disk into RAM"),
    ("rows_written", "rows_written", "Rows written to disk"),
    ("lookups_not_admitted", "lookups_not_admitted", "Lookups of keys not admitted yet (answered with initial rows)"),
    ("pushes_dropped", "pushes_dropped", "Pushed rows dropped (key not admitted)"),
    ("rows_expired", "rows_expired", "Rows deleted by the TTL sweep"),
    ("rows_evicted_rare", "rows_evicted_rare", "Rows deleted for a low access count"),
    ("rows_erased", "rows_erased", "Rows deleted by Erase"),
    ("values_clamped", "values_clamped", "Elements stored in 16 bits clamped to the type's largest finite value"),
    ("values_flushed", "values_flushed", "Non-zero elements rounded to zero when stored in 16 bits"),
)


class ShardCollector(Collector):
    """Reads ``shard``'s ``Stats`` at each scrape."""

    def __init__(self, shard: Shard) -> None:
        self._shard = shard

    def describe(self) -> list[Any]:
        return []  # collected on demand: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        s = shard_stats(self._shard)
        rows = GaugeMetricFamily(
            "ps_table_rows",
            "Rows held, by table and tier (ram or disk; disk is approximate where ps_table_rows_estimated is 1)",
            labels=["table", "tier"],
        )
        estimated = GaugeMetricFamily(
            "ps_table_rows_estimated",
            "1 when the table's disk row count started from RocksDB's estimate (reopened from disk)",
            labels=["table"],
        )
        mem = GaugeMetricFamily("ps_table_memory_bytes", "RAM held by a table's rows and index", labels=["table"])
        hit = GaugeMetricFamily(
            "ps_table_ram_hit_ratio", "Share of looked-up existing rows found in RAM", labels=["table"]
        )
        per_row = GaugeMetricFamily(
            "ps_table_bytes_per_row",
            "Bytes per row, by table and tier: in RAM what the memory budget charges per resident row; on disk "
            "the table's RocksDB files over its rows (0 without a data dir)",
            labels=["table", "tier"],
        )
        disk = GaugeMetricFamily("ps_table_disk_bytes", "The table's live RocksDB files", labels=["table"])
        totals = {f: CounterMetricFamily(f"ps_table_{name}", text, labels=["table"]) for f, name, text in _TABLE_TOTALS}
        for t in s.tables:
            rows.add_metric([t.name, "ram"], t.resident_rows)
            rows.add_metric([t.name, "disk"], t.spilled_rows)
            estimated.add_metric([t.name], int(t.rows_estimated))
            mem.add_metric([t.name], t.memory_bytes)
            hit.add_metric([t.name], t.ram_hit_rate)
            per_row.add_metric([t.name, "ram"], t.bytes_per_resident_row)
            per_row.add_metric([t.name, "disk"], t.disk_bytes / t.rows if t.rows else 0.0)
            disk.add_metric([t.name], t.disk_bytes)
            for f, family in totals.items():
                family.add_metric([t.name], getattr(t, f))
        yield from (rows, estimated, mem, hit, per_row, disk, *totals.values())
        yield from _health(s.tables)
        yield GaugeMetricFamily("ps_tables", "Tables held", value=len(s.tables))
        yield CounterMetricFamily(
            "ps_push_duplicates",
            "Pushes answered from the exactly-once ledger (a retry of one already applied)",
            value=s.duplicate_pushes,
        )
        yield GaugeMetricFamily("ps_resident_bytes", "RAM held by rows of every table", value=s.resident_bytes)
        yield GaugeMetricFamily(
            "ps_memory_budget_bytes", "--memory-budget-bytes (0: no limit)", value=s.memory_budget_bytes
        )
        yield CounterMetricFamily(
            "ps_storage_errors", "Data-dir writes or reads that failed", value=self._shard.storage_errors
        )
        yield GaugeMetricFamily(
            "ps_writable",
            "1 while the data dir takes writes (0: storage failed; a serving shard refuses pushes by mode either way)",
            # Stats.writable is false on a serving shard by mode; its storage is healthy
            # while it names no storage error.
            value=int(s.writable or (s.mode != "train" and not s.storage_error)),
        )
        yield GaugeMetricFamily(
            "ps_background_loops_failing", "Background loops failing now", value=len(s.failing_loops)
        )
        yield GaugeMetricFamily("ps_version", "Changes applied (training) or served (following)", value=s.version)
        yield GaugeMetricFamily("ps_uptime_seconds", "Seconds since the shard started", value=s.uptime_s)
        if s.HasField("follow"):
            follow = s.follow
            yield GaugeMetricFamily(
                "ps_follow_lag_versions", "Versions the training shard is ahead", value=follow.lag_versions
            )
            yield GaugeMetricFamily(
                "ps_follow_lag_seconds",
                "Age of the oldest training-shard change not applied yet (0: caught up)",
                value=follow.lag_s,
            )
            yield GaugeMetricFamily(
                "ps_follow_connected", "1 while the change stream is open", value=int(follow.connected)
            )
            yield CounterMetricFamily("ps_follow_snapshots", "Full snapshots received", value=follow.snapshots)


IDLE_QUANTILES = (0.5, 0.9, 0.99)


def _health(tables: Iterable[pb.TableStats]) -> Iterator[Any]:
    """Embedding health per table (``ps.table.health``), for tables that keep it."""
    norm = HistogramMetricFamily(
        "ps_table_row_norm", "L2 norm of sampled rows after a push (at most 16 rows a push)", labels=["table"]
    )
    update = HistogramMetricFamily(
        "ps_table_update_norm", "L2 norm of what a push changed in the sampled rows", labels=["table"]
    )
    touched = GaugeMetricFamily(
        "ps_table_rows_touched", "Resident rows looked up or pushed within the latest health window", labels=["table"]
    )
    idle = GaugeMetricFamily(
        "ps_table_row_idle_seconds",
        "Seconds since a resident row's last lookup or push, by quantile over the rows (latest scan; bucket bound)",
        labels=["table", "quantile"],
    )
    nonfinite = CounterMetricFamily(
        "ps_table_nonfinite_rows", "Sampled rows that held NaN or Inf after a push", labels=["table"]
    )
    for t in tables:
        if not t.health_window_s:
            continue
        for family, h in ((norm, t.row_norm), (update, t.update_norm)):
            cumulative = np.cumsum(np.asarray(h.counts, np.int64)).tolist()
            bounds = np.frombuffer(h.le, "<f8").tolist()
            buckets = [(repr(le), n) for le, n in zip(bounds, cumulative, strict=False)] + [("+Inf", cumulative[-1])]
            family.add_metric([t.name], buckets, sum_value=h.sum)
        nonfinite.add_metric([t.name], t.nonfinite_rows)
        if t.health_scanned_unix_s:
            touched.add_metric([t.name], t.rows_touched)
            for q in IDLE_QUANTILES:
                idle.add_metric(
                    [t.name, str(q)], bucket_quantile(np.frombuffer(t.row_idle_s.le, "<f8"), t.row_idle_s.counts, q)
                )
    yield from (norm, update, touched, idle, nonfinite)


def shard_registry(shard: Shard) -> CollectorRegistry:
    """A registry with ``shard``'s collector (RPC metrics are added by the server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ShardCollector(shard))
    return registry
