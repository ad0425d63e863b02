"""``TableCounters``: the running totals a table keeps for ``Stats``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TableCounters"]


@dataclass
class TableCounters:
    """Running totals for ``Stats`` (keys, not requests).

    ``ram_hits``/``ram_misses`` count looked-up keys that have a row: found in RAM, or
    read back from disk. A key without a row is neither: its new row counts in
    ``rows_created`` (or, not admitted yet, in ``lookups_not_admitted``). So a table
    without a disk has no misses, and a tiered one's hit rate is the share of its
    existing rows that lookups found in RAM.
    """

    lookups: int = 0
    pushes: int = 0
    rows_created: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    rows_spilled: int = 0
    rows_faulted_in: int = 0
    rows_written: int = 0
    lookups_not_admitted: int = 0
    pushes_dropped: int = 0
    rows_expired: int = 0
    rows_evicted_rare: int = 0
    rows_erased: int = 0
