"""``Stats``: what a shard reports about itself and each of its tables."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from ps.shard import Shard
from ps.store import precision
from ps.table import IDLE_BOUNDS_S, LogHistogram, TableHealth

__all__ = ["shard_stats"]


def _histogram(h: LogHistogram) -> pb.Histogram:
    return pb.Histogram(le=_bounds(h.bounds), counts=h.counts.tolist(), sum=h.total, recent=h.recent.tolist())


def _bounds(bounds: npt.NDArray[np.float64]) -> bytes:
    return bounds.astype("<f8").tobytes()


def _health(health: TableHealth | None, window_s: float) -> dict[str, Any]:
    """The health fields of a table's ``TableStats`` (none with health off)."""
    if health is None:
        return {}
    scan = health.latest
    return {
        "row_norm": _histogram(health.row_norm),
        "update_norm": _histogram(health.update_norm),
        "nonfinite_rows": health.nonfinite_rows,
        "health_window_s": window_s,
        **(
            {
                "rows_touched": scan.touched,
                "row_idle_s": pb.Histogram(le=_bounds(IDLE_BOUNDS_S), counts=scan.idle.tolist()),
                "health_scanned_unix_s": scan.unix_s,
            }
            if scan is not None
            else {}
        ),
    }


def shard_stats(shard: Shard) -> pb.StatsResponse:
    """Counters of ``shard`` and of every table, the background loops failing now, and
    (a serving shard) where its rows come from."""
    tables = []
    for t in shard.tables():
        c, resident = t.counters, len(t)
        seen = c.ram_hits + c.ram_misses
        spill_rate, fault_rate, new_rate = shard.rates.rates(t.spec.name, 3)
        tables.append(
            pb.TableStats(
                name=t.spec.name,
                dim=t.dim,
                rows=resident + t.spilled,
                rows_estimated=t.rows_estimated,
                memory_bytes=t.memory_bytes(),
                resident_rows=resident,
                spilled_rows=t.spilled,
                bytes_per_resident_row=t.bytes_per_row,
                ram_hit_rate=c.ram_hits / seen if seen else 1.0,
                spill_rows_per_s=spill_rate,
                fault_in_rows_per_s=fault_rate,
                admission_bytes=t.admission_bytes(),
                storage_dtype=precision.to_wire(t.spec.storage_dtype),
                state_dtype=precision.to_wire(t.spec.state_dtype),
                record_bytes=t.format.record_bytes,
                disk_bytes=t.disk_bytes(),
                values_clamped=t.rounding.clamped,
                values_flushed=t.rounding.flushed,
                new_keys_per_s=new_rate,
                **_health(t.health, shard.health_window_s),
                **dataclasses.asdict(c),  # every running total, under its own name
            )
        )
    stored = shard.storage is not None
    return pb.StatsResponse(
        shard=shard.index,
        num_shards=shard.num_shards,
        mode=shard.mode,
        uptime_s=time.monotonic() - shard.started,
        tables=tables,
        duplicate_pushes=shard.duplicate_pushes(),
        memory_budget_bytes=shard.memory_budget_bytes,
        resident_bytes=shard.resident_bytes(),
        durability=str(shard.durability) if stored else "",
        writable=shard.writable and shard.role.takes_writes,  # a serving shard refuses pushes by its role
        storage_error=shard.storage_error,
        last_durable_unix_s=shard.last_durable if stored else 0.0,
        failing_loops=[pb.LoopFailure(**dataclasses.asdict(f)) for f in shard.health.failing()],
        version=shard.role.version,
        follow=shard.source.status() if shard.source is not None else None,
        lineage=shard.role.lineage,
    )
