"""``HeldTable``: a table held by ``Table.held``, and what may run on it while nothing
else does: a flush as one consistent cut (checkpoints, clean stops), the copies of its
unwritten rows (a stop whose disk fails saves them elsewhere), its row count.

It works on the table's parts (its RAM and disk halves, its ledgers and counters), which
the table hands it with its locks held; it is valid only inside that ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

from ps.store import Rows
from ps.table.counters import TableCounters
from ps.table.ledger import TableLedgers
from ps.table.ram import CLEAN, RamTier
from ps.table.spec import TableSpec
from ps.table.tier import DiskTier

__all__ = ["HeldTable", "held_tables"]


class HeldTable:
    """A held table (see the module docstring). ``rows``: its rows, resident and on disk."""

    def __init__(
        self,
        spec: TableSpec,
        ram: RamTier,
        disk: DiskTier | None,
        ledgers: TableLedgers,
        counters: TableCounters,
        rows: int,
    ) -> None:
        self.spec = spec
        self.ledgers = ledgers
        self.rows = rows
        self._ram, self._disk, self._counters = ram, disk, counters

    def flush(self, metadata: bool = True) -> int:
        """``Table.flush`` as one cut, under the hold (see there); returns rows written."""
        if self._disk is None:
            return 0
        lc = self.spec.lifecycle
        if metadata and (lc.ttl_seconds or lc.evict_below_frequency):
            keys, slots = self._ram.items()
        else:
            keys, slots = self._ram.dirty_items()
        changed = self.ledgers.take_changed()
        if not keys.size and not changed:
            return 0
        try:
            for s in self._disk.write_held(self._ram, keys, slots, changed):
                self._counters.rows_written += s.shape[0]
                self._ram.mark(s, CLEAN)
                changed = []
        finally:
            self.ledgers.mark_changed([key for key, _ in changed])
        return int(keys.shape[0])

    @property
    def rows_estimated(self) -> bool:
        """Whether ``rows`` counts from RocksDB's estimate (a table reopened from disk)."""
        return self._disk is not None and self._disk.estimated

    def unpersisted(self) -> Rows:
        """Copies of every resident row that is not on disk as it is in RAM (a shard
        stopping with a failed disk saves these elsewhere)."""
        return self._ram.arena.rows(*self._ram.dirty_items())


class Holdable(Protocol):
    """What ``held_tables`` holds: a ``ps.table.Table``."""

    @property
    def spec(self) -> TableSpec: ...

    def held(self) -> contextlib.AbstractContextManager[HeldTable]: ...


@contextlib.contextmanager
def held_tables(tables: Sequence[Holdable]) -> Iterator[list[HeldTable]]:
    """Hold every table of ``tables`` (see ``Table.held``), in name order, for the block."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(t.held()) for t in sorted(tables, key=lambda t: t.spec.name)]
