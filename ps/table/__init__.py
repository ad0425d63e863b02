"""One embedding table on one shard: its spec, its key index, its RAM and disk halves, the
optimizers and initial rows it applies, its lifecycle rules and the exactly-once ledgers
of the pushes it took, and its health (``ps.table.health``). ``Table`` is the door to a table's rows: nothing else touches its
halves.
"""

from __future__ import annotations

from ps.table.health import IDLE_BOUNDS_S, LogHistogram, TableHealth, bucket_quantile
from ps.table.held import held_tables
from ps.table.initializers import InitializerKind, InitializerParams
from ps.table.ledger import KeyOrigins
from ps.table.lifecycle import EVICTIONS, LFU_HALF_LIFE_S, Eviction, Lifecycle, now_tick
from ps.table.optimizers import OptimizerKind, OptimizerParams
from ps.table.ram import RamTier
from ps.table.spec import TableSpec, spec_from_proto, spec_to_proto
from ps.table.table import Table

__all__ = [
    "EVICTIONS",
    "Eviction",
    "IDLE_BOUNDS_S",
    "InitializerKind",
    "InitializerParams",
    "KeyOrigins",
    "LFU_HALF_LIFE_S",
    "Lifecycle",
    "LogHistogram",
    "OptimizerKind",
    "OptimizerParams",
    "RamTier",
    "Table",
    "TableHealth",
    "TableSpec",
    "bucket_quantile",
    "held_tables",
    "now_tick",
    "spec_from_proto",
    "spec_to_proto",
]
