"""A shard's tables by name: creating them (their specs stored in the data dir first),
reopening them from it, and swapping the whole set (a serving shard pinned to a
checkpoint serves that checkpoint's tables).

Example:
    >>> from ps.table import TableSpec
    >>> tables = TableRegistry(0)
    >>> tables.install(TableSpec("item", dim=8)), tables.install(TableSpec("item", dim=8))
    (True, False)
    >>> [t.spec.name for t in tables.all()]
    ['item']
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from protos import ps_pb2 as pb
from ps.errors import TableExists, UnknownTable
from ps.shard.limits import Limits
from ps.store import Storage
from ps.table import Table, TableSpec, held_tables, spec_from_proto, spec_to_proto

__all__ = ["TableRegistry"]

log = logging.getLogger(__name__)


class TableRegistry:
    """The tables of shard ``index``. Thread-safe: one lock guards the set (each table
    has its own for its rows).

    With ``storage``, a table's rows spill to and fault in from the data dir, and every
    table stored there is reopened at once. ``every_push`` (durability): a table writes
    each push before it is acknowledged. ``guard(fn, *args)`` runs a storage write and
    records its failure, ``on_write_failure`` hears a table's; ``check_writable()``
    raises ``StorageFailed`` while the data dir refuses writes. ``health``: tables sample
    their pushed rows (``ps.table.health``).
    """

    def __init__(
        self,
        index: int,
        storage: Storage | None = None,
        *,
        every_push: bool = False,
        limits: Limits | None = None,
        guard: Callable[..., Any] = lambda fn, *args: fn(*args),
        check_writable: Callable[[], None] = lambda: None,
        on_write_failure: Callable[[str], None] = lambda error: None,
        health: bool = True,
    ) -> None:
        self._index = index
        self._health = health
        self._storage = storage
        self._every_push = every_push
        self._limits = limits or Limits()
        self._guard = guard
        self._check_writable = check_writable
        self._on_write_failure = on_write_failure
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        if storage is not None:
            for name, blob in sorted(storage.specs().items()):
                self._tables[name] = self._new(spec_from_proto(pb.TableSpec.FromString(blob)))
            if self._tables:
                log.info("reopened %d tables from %s: %s", len(self._tables), storage.path, ", ".join(self._tables))

    def _new(self, spec: TableSpec) -> Table:
        if self._storage is None:
            return Table(spec, health=self._health)
        rows = self._storage.table(spec.name, spec.row_format)
        return Table(
            spec,
            rows=rows,
            storage=self._storage,
            every_push=self._every_push,
            on_write_failure=self._on_write_failure,
            health=self._health,
        )

    def install(self, spec: TableSpec, limited: bool = False) -> bool:
        """Create ``spec``'s table; False if an identical one exists. ``limited``: a new
        one must fit ``limits.max_tables``. Raises ``TableExists`` naming every differing
        field if the name is taken by another spec, ``StorageFailed`` if the spec cannot
        be stored."""
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is None and limited:
                self._limits.check_new_table(self._index, len(self._tables))
            if existing is not None:
                diff = existing.spec.differences(spec)
                if diff:
                    raise TableExists(
                        f"table {spec.name!r} exists with a different spec: {'; '.join(diff)} (existing != requested)"
                    )
                return False
            if self._storage is not None:
                self._check_writable()
                self._guard(self._storage.save_spec, spec.name, spec_to_proto(spec).SerializeToString())
            self._tables[spec.name] = self._new(spec)
        log.info("table created name=%s dim=%d optimizer=%s", spec.name, spec.dim, spec.optimizer.kind.name)
        return True

    def get(self, name: str) -> Table:
        """The table called ``name``; raises ``UnknownTable`` listing the ones that exist."""
        try:
            return self._tables[name]
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise UnknownTable(f"table {name!r} does not exist on shard {self._index} (tables: {known})") from None

    def swap(self, tables: dict[str, Table]) -> dict[str, Table]:
        """Hold ``tables`` from now on; returns the ones held until now."""
        with self._lock:
            previous, self._tables = self._tables, tables
        return previous

    def all(self) -> list[Table]:
        """Every table, sorted by name."""
        with self._lock:
            return [self._tables[n] for n in sorted(self._tables)]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No table is created, swapped or used meanwhile (every lock held)."""
        with self._lock, held_tables(list(self._tables.values())):
            yield
