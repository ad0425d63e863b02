"""One shard: its tables by name, its mode, its place in the cluster, its data directory.

``Shard`` is what the gRPC servicer talks to, one method per RPC, and what tests drive
without a network. It checks that a request was routed for this cluster's size and
within its ``limits``, validates every entry before anything is applied, runs pushes
through each table's exactly-once ledger, and (with a ``Storage``) keeps the tables
within the memory budget, writes them out as the durability mode says, expires rows,
and takes checkpoints (``ps.durability.checkpoint``).

Modes: a ``train`` shard creates the row of a key on its first lookup, takes pushes, and
numbers both in its change log (``changes``, streamed to followers by ``ps.replication.stream``); a
``serve`` shard reads a key without a row as its default, stores nothing, refuses every
write with ``WrongMode``, and gets its rows from its ``source`` (``ps.replication.follow``).

A storage failure (disk full, I/O error) makes the shard read-only: pushes get
UNAVAILABLE, lookups keep working, nothing is evicted, ``writable`` listeners hear it,
and the maintenance thread retries until the data dir takes writes (``ps.shard.recovery``).
Background loops report each run to ``health`` (``ps.shard.background``). ``shutdown`` writes
every dirty row, retrying for its grace period; rows of acknowledged pushes it still
could not write go to a rescue dump (``ps.durability.rescue``) that its ``StopReport`` names.

Example:
    >>> from ps.table import TableSpec
    >>> shard = Shard(index=0, num_shards=1)
    >>> shard.create_table(TableSpec("item", dim=8))
    True
    >>> import numpy as np
    >>> rows = np.zeros((2, 8), dtype=np.float32)
    >>> shard.lookup(LookupBatch([("item", np.array([3, 4]))]), lambda specs: [rows])
    >>> bool(rows.any())  # the two new rows' initial values
    True
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import wire
from ps.durability import (
    Durability,
    RescueBase,
    StopReport,
    checkpoint_parts,
    checkpoint_root_of,
    checkpoint_target,
    dump_places,
    read_base,
    read_parts,
    replace_rows,
    rows_at_risk,
    save_rescue,
    write_checkpoint,
)
from ps.elastic import ClusterMap, Reshard, ReshardParts, ReshardSettings, Route, move_batches
from ps.errors import (
    InvalidRequest,
    ShardMismatch,
    ShuttingDown,
)
from ps.replication import ChangeLog, follow_batches
from ps.rwlock import ReadWriteLock
from ps.shard.background import LoopHealth, RateWindow
from ps.shard.batches import MODES, LookupBatch, LookupEntries, Mode, PushBatch, RowSource
from ps.shard.budget import MemoryBudget, check_budget
from ps.shard.erasing import Erasing, ErasingParts
from ps.shard.limits import Limits
from ps.shard.maintenance import Maintenance
from ps.shard.recovery import ACKNOWLEDGED_ON_DISK, ROWS_FROM_SOURCE, StorageHealth, reopen_if_refusing
from ps.shard.registry import TableRegistry
from ps.shard.roles import Role, Serving, Training
from ps.store import Storage, StorageFailed, precision
from ps.table import Eviction, Table, TableSpec

__all__ = ["Shard"]

log = logging.getLogger(__name__)


_DEFAULT_DURABILITY = Durability("interval", 5.0)
HEALTH_WINDOW_S = 60.0


class Shard:
    """Tables, mode, cluster identity and storage of one shard. Thread-safe.

    ``storage``: the opened data directory (tables stored there are recreated at
    once; their rows come back from disk when first used). ``memory_budget_bytes``
    (needs storage): resident bytes above which rows are spilled, in ``eviction``
    order; 0 = no limit (``ps.shard.budget``). ``limits``: what one request and the shard
    may hold (``ps.shard.limits``). ``rescue_dir``: where a stop that cannot write its rows
    saves them first (``ps.durability.rescue``). ``health_window_s``: how often each table's
    resident rows are scanned for their health, and the window "rows touched" counts over;
    0 turns embedding health off (no push is sampled either; ``ps.table.health``).
    ``checkpoint_root``: the only directory checkpoints may be written under (see
    ``ps.durability.checkpoint``); default ``<data dir>/checkpoints``, none without storage.
    ``mode``: ``"train"`` or ``"serve"`` (see the module docstring).
    """

    def __init__(
        self,
        index: int,
        num_shards: int,
        storage: Storage | None = None,
        durability: Durability = _DEFAULT_DURABILITY,
        memory_budget_bytes: int = 0,
        checkpoint_root: Path | None = None,
        *,
        mode: Mode = "train",
        eviction: Eviction = "lfu",
        limits: Limits | None = None,
        rescue_dir: Path | None = None,
        changes: ChangeLog | None = None,
        source: Callable[[Shard], RowSource] | None = None,
        resharding: ReshardSettings | None = None,
        health_window_s: float = HEALTH_WINDOW_S,
    ) -> None:
        if index < 0 or num_shards < 1:
            raise ValueError(f"shard={index}, num_shards={num_shards}: need index >= 0 and num_shards >= 1")
        check_budget(memory_budget_bytes, storage is not None)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
        if source is not None and mode != "serve":
            raise ValueError("source: only a serving shard (mode='serve') takes its rows from a source")
        training = mode == "train"  # the one decision: a training or a serving shard (``ps.shard.roles``)
        self.index = index
        self.limits = limits or Limits()
        self.storage = storage
        self.durability = durability
        self.budget = MemoryBudget(
            memory_budget_bytes, eviction, tables=self.tables, guard=self._guard, writable=lambda: self.writable
        )
        self.checkpoint_root = checkpoint_root_of(storage.path if storage is not None else None, checkpoint_root)
        self.rescue_dir = rescue_dir  # --rescue-dir, tried first (``ps.durability.rescue.dump_places``)
        self.rescue_base = read_base(storage) if storage is not None else RescueBase()  # noted in a dump
        # Which data the rows are (``Stats.lineage``): the data dir's, made at its first start
        # and carried by its checkpoints; a shard without one holds new data at every start.
        self.lineage = self.rescue_base.lineage or ("" if storage is not None else uuid.uuid4().hex)
        self.health = LoopHealth()
        self.started = time.monotonic()
        self.last_durable = time.time()
        self._storage_health = StorageHealth(index)
        self._tables = TableRegistry(
            index,
            storage,
            every_push=durability.kind == "every-push",
            limits=self.limits,
            guard=self._guard,
            check_writable=self._storage_health.check,
            on_write_failure=self._storage_health.failed,
            health=health_window_s > 0,
        )
        self.health_window_s = health_window_s
        self._checkpoint_lock = threading.Lock()
        self._closing = False
        self.rates = RateWindow()
        self._maintenance = Maintenance(
            f"ps-shard{index}-maint",
            tables=self.tables,
            rates=self.rates,
            health=self.health,
            storage=self._storage_health if storage is not None else None,
            recover=self._recover,
            flush=lambda: self.flush(metadata=False),
            expire=self.expire,
            sweep_ttls=lambda: self.writable and self.role.takes_writes and not self.reshard.copying,
            flush_interval_s=durability.interval_s if durability.kind == "interval" and storage is not None else None,
            health_window_s=health_window_s,
        )
        self.changes = changes or ChangeLog()  # a training shard's versions, for serving shards that follow it
        # The cluster map this shard routes by, and its part in a live reshard (``ps.elastic.reshard``).
        self.reshard = Reshard(
            index,
            num_shards,
            storage,
            ReshardParts(
                tables=self.tables,
                install_table=lambda spec: self.install_table(spec, limited=True),
                changes=self.changes,
                flush=lambda: self.flush(metadata=True),
                settings=resharding if resharding is not None and training else ReshardSettings(),
            ),
        )
        # A serving shard's lookups read under it, together; whatever swaps or changes its
        # rows (``ps.replication.follow``) writes under it, so a lookup sees a change batch whole or not at all.
        self.serve_lock = ReadWriteLock()
        self.role: Role = (
            Training(index, self.reshard.writing, self.changes, self.lineage)
            if training
            else Serving(index, self.serve_lock, lineage=self.lineage)
        )
        if isinstance(self.role, Serving) and source is not None:
            self.role.source = source(self)
        self.erasing = Erasing(
            ErasingParts(
                index,
                self.table,
                storage,
                self.checkpoint_root,
                dump_places(storage.path.absolute(), rescue_dir, self.checkpoint_root) if storage is not None else [],
                self.changes,
                self.reshard,
                self.role,
                self.serve_lock,
                self._guard,
                self._checkpoint_lock,
            )
        )

    @property
    def num_shards(self) -> int:
        """The size of the cluster map this shard routes by (a live reshard changes it)."""
        return self.reshard.map.num_shards

    @property
    def mode(self) -> Mode:
        """``"train"`` or ``"serve"`` (``role.mode``), as the shard was built."""
        return self.role.mode

    @property
    def source(self) -> RowSource | None:
        """Where a serving shard's rows come from (None on a training shard)."""
        return self.role.source

    @property
    def memory_budget_bytes(self) -> int:
        """Resident bytes above which rows are spilled (``budget``); 0 = no limit."""
        return self.budget.limit_bytes

    @property
    def writable(self) -> bool:
        """False while the data dir refuses writes (pushes are refused meanwhile)."""
        return self._storage_health.writable

    @property
    def storage_error(self) -> str:
        """The latest storage error while not ``writable``, else ""."""
        return self._storage_health.error

    def on_writable_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(writable)`` when the shard starts or stops accepting writes."""
        self._storage_health.on_change(listener)

    # -- tables --------------------------------------------------------------------------

    def create_table(self, spec: TableSpec) -> bool:
        """Create ``spec``'s table; False if an identical one exists.

        Raises ``WrongMode`` on a serving shard, ``TableExists`` naming every differing
        field if the name is taken by another spec, ``StorageFailed`` if the spec cannot
        be stored.
        """
        self.role.refuse_writes("CreateTable")
        if spec.storage_dtype == precision.INT8:
            raise InvalidRequest(f"table {spec.name!r}: storage_dtype int8 is for serving shards (--serve-dtype int8)")
        return self.install_table(spec, limited=True)

    def install_table(self, spec: TableSpec, limited: bool = False) -> bool:
        """``create_table`` in any mode: how a serving shard takes its leader's tables
        (``limited``: a new one must fit ``limits.max_tables``). A new table is a change of
        its own (a version with no keys): followers get its spec before it has a row."""
        created = self._tables.install(spec, limited)
        if created:
            self.changes.record([])
        return created

    def table(self, name: str) -> Table:
        """The table called ``name``; raises ``UnknownTable`` listing the ones that exist."""
        return self._tables.get(name)

    def swap_tables(self, tables: dict[str, Table]) -> dict[str, Table]:
        """Serve ``tables`` from now on; returns the ones served until now (``ps.replication.follow``).
        Logs a warning when they take more RAM than the memory budget allows and hold rows
        it cannot evict (tables converted to ``--serve-dtype`` live in RAM alone)."""
        previous = self._tables.swap(tables)
        held_whole = any(not t.evictable for t in tables.values())
        if held_whole and self.budget.limit_bytes and self.budget.resident_bytes() > self.budget.limit_bytes:
            log.warning(
                "this shard's tables take %d bytes of RAM, over --memory-budget-bytes=%d, and those converted to "
                "--serve-dtype are held whole (only rows on disk can be evicted): give the shard more memory, or "
                "serve the stored type",
                self.budget.resident_bytes(),
                self.budget.limit_bytes,
            )
        return previous

    def tables(self) -> list[Table]:
        """Every table, sorted by name (``ps.shard.registry``)."""
        return self._tables.all()

    def specs(self) -> list[TableSpec]:
        """The spec of every table, sorted by name."""
        return [t.spec for t in self.tables()]

    def check_request(self, route: Route | None = None) -> None:
        """Raise unless a request sent along ``route`` may run here now (``ps.elastic.reshard``)."""
        if self._closing:
            raise ShuttingDown(f"shard {self.index} is shutting down")
        if route is not None:
            self.reshard.check_route(route)

    def check_writable(self) -> None:
        """Raise ``WrongMode`` if this shard refuses pushes (serving mode), ``StorageFailed``
        if its storage failed."""
        self.role.refuse_writes("Push")
        self._storage_health.check()

    @staticmethod
    def check_table_field(name: str, field: str) -> None:
        """Raise ``InvalidRequest`` if a request entry has no table name."""
        if not name:
            raise InvalidRequest(f"{field}: table name is empty")

    def _entry_table(self, name: str, i: int) -> Table:
        self.check_table_field(name, f"entries[{i}].table")
        return self.table(name)

    # -- requests ------------------------------------------------------------------------

    def lookup(
        self,
        batch: LookupBatch,
        out: Callable[[Sequence[TableSpec]], Sequence[npt.NDArray[np.float32]]],
        *,
        read_only: bool = False,
    ) -> None:
        """Gather the rows of ``batch`` into the arrays ``out(specs)`` returns. The route is
        checked first, then the entries are decoded (``LookupBatch.decoded``); ``out`` is
        called once, after the key counts and tables are checked, with the spec of each
        entry's table, and returns one writable float32 ``[len(keys), dim]`` array per entry
        (the caller's response buffer; it may raise, e.g. ``RequestTooLarge``); then every
        key's owner is checked, and only then are rows created and gathered into them.

        Training mode creates the rows of missing keys; serving mode reads them as their
        table's default (zeros, or their initial rows) and stores nothing, and notes a
        row's use only where a memory budget evicts by it. ``read_only`` (a caller with
        a read token) makes a training shard read as serving mode does, noting no use:
        it creates, counts and streams to followers nothing. Raises ``ShuttingDown``,
        ``ShardMismatch`` (``WrongShard`` for a key this shard does not own),
        ``InvalidRequest`` (naming the entry and field), ``UnknownTable``; ``StorageFailed``
        if disk reads fail."""
        self.check_request(batch.route)
        entries = batch.decoded()
        # A serving shard's rows change only in whole batches (and its tables may be
        # swapped for a checkpoint's): it answers under the lock those changes take. A
        # training shard's lookups may create rows: they are writes a reshard's freeze waits for.
        with self.role.reading():
            self._lookup(entries, out, read_only)

    def _lookup(
        self,
        entries: LookupEntries,
        out: Callable[[Sequence[TableSpec]], Sequence[npt.NDArray[np.float32]]],
        read_only: bool,
    ) -> None:
        self.limits.check_keys("Lookup", (k.shape[0] for _, k in entries))
        tables = [self._entry_table(name, i) for i, (name, _) in enumerate(entries)]
        rows = out([t.spec for t in tables])
        create, touch = self.role.reads(read_only=read_only, budget_evicts=self.budget.limit_bytes > 0)
        # Keys a reshard is handing over are read without creating rows: their initial rows,
        # which their new owner creates.
        handing_over = self.reshard.check_keys("Lookup", entries, write=False)
        initial = handing_over and create
        if initial:
            create = touch = False
        created: list[tuple[str, npt.NDArray[np.int64]]] = []
        for table, (_, keys), target in zip(tables, entries, rows, strict=True):
            before = table.counters.rows_created
            table.lookup(keys, target, create=create, touch=touch, initial=initial)
            if table.counters.rows_created != before:  # new rows: followers must see them too
                created.append((table.spec.name, keys.copy()))
        if created:
            self.changes.record(created)
        self.budget.after_request()

    def push(self, batch: PushBatch) -> tuple[bool, int]:
        """Apply ``batch`` once per ``(client_id, table, seq)``; returns (applied
        anywhere, distinct rows updated). Every entry is checked (gradient shapes, NaN
        and Inf: the one place a request's gradients are validated) before any is applied.

        Raises ``ShuttingDown``, ``ShardMismatch`` (``WrongShard`` for a key this shard
        does not own), ``WrongMode`` (serving mode), ``StorageFailed`` (storage failed:
        nothing applied), ``InvalidRequest`` (naming the entry and field), ``UnknownTable``.
        """
        self.check_request(batch.route)
        self.check_writable()
        entries = batch.entries_with(lambda i, name: self._entry_table(name, i).dim)
        self.limits.check_keys("Push", (k.shape[0] for _, k, _ in entries))
        tables = []
        for i, (name, keys, grads) in enumerate(entries):
            table = self._entry_table(name, i)
            table.validate_grads(keys, grads)
            tables.append(table)
        with self.reshard.writing():
            self.reshard.check_keys("Push", [(n, k) for n, k, _ in entries], write=True)
            applied, rows = False, 0
            changed = []
            for i, (table, (_, keys, grads)) in enumerate(zip(tables, entries, strict=True)):
                origins = self.reshard.origins(*batch.planned, keys)
                if origins is not None and origins.skip:
                    continue
                n = self._guard(
                    table.push,
                    keys,
                    grads,
                    client_id=batch.client_id,
                    seq=batch.seq_of(i),
                    check=False,
                    origins=origins,
                )
                if n is not None:
                    applied, rows = True, rows + n
                    if keys.shape[0]:  # an entry without keys only records its seq
                        changed.append((table.spec.name, keys.copy()))  # a copy: the view would keep the request
            if changed:
                self.changes.record(changed)
        if self.durability.kind == "every-push" and self.storage is not None:
            self.last_durable = time.time()
        self.budget.after_request()
        return applied, rows

    def follow(
        self, follower: Route, history: str, version: int, active: Callable[[], bool], max_message_bytes: int
    ) -> Iterator[pb.FollowBatch]:
        """The change stream of this training shard for the serving shard ``follower``
        (``route``: its index and cluster size) that holds ``(history, version)``:
        batches under ``max_message_bytes`` until ``active()`` turns false or this shard
        stops (``ps.replication.stream``). Raises ``ShuttingDown``, ``WrongMode`` on a serving shard
        (followers follow training shards), ``ShardMismatch`` when the follower's index or
        cluster size differ."""
        self.check_request()
        self.role.refuse_following()
        sizes = self.reshard.sizes()
        if follower.shard != self.index or follower.num_shards not in sizes:
            raise ShardMismatch(
                f"a follower of shard {follower.shard} of {follower.num_shards} reached shard {self.index} of "
                f"{self.num_shards}: give each serving shard the address of the training shard with its index"
            )
        return follow_batches(
            self.changes,
            self.tables,
            history,
            version,
            lambda: active() and not self._closing,
            max_message_bytes,
            lineage=self.lineage,
            owned=lambda keys: self.reshard.map.owns(keys, self.index),
            num_shards=lambda: self.num_shards,
            publications=self.role.publications if isinstance(self.role, Training) else None,
            quiet_version=self._quiet_version,
        )

    def _quiet_version(self) -> int:
        """The change log's version at a moment no push is being applied: every write up to
        it is whole in the tables, and none after it has begun."""
        with self.reshard.quiet():
            return self.changes.version

    def serve_from(self, checkpoint: str) -> pb.FollowStatus:
        """Serve this serving shard's part of ``checkpoint`` ("": its own source again);
        returns its source's status. Raises ``WrongMode`` on a training shard,
        ``InvalidRequest`` for a checkpoint it cannot serve."""
        self.check_request()
        return self.role.serve_from(checkpoint)

    def publish(self, request: pb.PublishRequest) -> pb.PublishResponse:
        """Publish this training shard's rows, or hold or release publishing
        (``ps.replication.publish``). Raises ``WrongMode`` on a serving shard."""
        self.check_request()
        return self.role.publish(request)

    @property
    def publication(self) -> str:
        """The publication a ``--published-only`` serving shard's rows are of ("": none, or
        another kind of shard); read under the lock lookups hold, it names their rows."""
        return self.role.publication

    def roll_back(self) -> pb.FollowStatus:
        """A ``--published-only`` serving shard: serve the publication before the current one
        again. Raises ``WrongMode`` on a training shard, ``InvalidRequest`` with none to go back to."""
        self.check_request()
        return self.role.roll_back()

    def erase(self, request: pb.EraseRequest) -> pb.EraseResponse:
        """Delete the rows of ``request.keys`` in ``request.table`` for good (``ps.shard.erasing``),
        and of ``request.others`` (keys other shards own) from this shard's checkpoints and
        rescue dumps, and from its data dir if it gave them away in a reshard:
        on a training shard from RAM and the data dir, the followers through the change log,
        with ``request.checkpoints`` every checkpoint part and rescue dump, with
        ``request.compact`` compacting the data dir after; on a serving shard, with
        ``request.served`` only, the rows it still holds (``WrongMode`` without). With ``request.verify``, change nothing and count the rows held. Raises
        ``WrongShard`` for a key this shard does not own, ``Moving`` for a key it is handing
        over, ``UnknownTable``, ``InvalidRequest`` for bad keys, ``StorageFailed``."""
        route = Route(request.num_shards, request.shard if request.HasField("shard") else None, request.epoch)
        self.check_request(route)
        self.check_table_field(request.table, "table")
        keys = np.unique(wire.decode_keys(request.keys, "keys"))
        others = np.setdiff1d(wire.decode_keys(request.others, "others"), keys)
        self.limits.check_keys("Erase", [keys.shape[0]])
        self.limits.check_keys("Erase (others)", [others.shape[0]])
        table = self.table(request.table)
        if request.verify or request.served:  # the keys it owns by its map: a client behind it routes again
            self.reshard.check_keys("Erase", [(request.table, keys)], write=False)
        if request.verify:
            return self.erasing.verify(table, np.union1d(keys, others), request.checkpoints)
        if not self.role.takes_writes:
            if not request.served:  # an erase sent to the serving shards by mistake: the rows stay on training
                self.role.refuse_writes("Erase")
            # Rows of other shards' keys it holds are ones its last map switch left (keys it owns by its
            # map are its training shard's, sent to it as keys when the client routes by that map).
            leftover = others[~self.reshard.map.owns(others, self.index)]
            return self.erasing.erase_served(table, np.union1d(keys, leftover), compact=request.compact)
        if request.served:
            raise InvalidRequest(
                f"Erase: served=true is for serving shards, once they applied the erase; shard {self.index} is a "
                "training shard: send the erase without it"
            )
        self._storage_health.check()
        return self.erasing.erase(table, keys, others, compact=request.compact, checkpoints=request.checkpoints)

    def get_map(self) -> pb.GetMapResponse:
        """The cluster map this shard routes by, and where a reshard stands here."""
        self.check_request()
        return self.reshard.get_map(self.source.status() if self.source is not None else None)

    def reshard_request(self, request: pb.ReshardRequest) -> pb.ReshardStatus:
        """One phase of a live reshard (``ps.elastic.reshard``; a serving shard takes only the
        switch to a new map, COMMIT); the status after it. Raises ``WrongMode``,
        ``InvalidRequest`` for maps or a phase that do not fit, ``Moving`` for one to retry
        shortly, ``StorageFailed``."""
        self.check_request()
        return self.reshard.request(request, serving=not self.role.takes_writes)

    def move_rows(
        self, to: ClusterMap, destination: int, active: Callable[[], bool], max_bytes: int, max_rows_per_s: float = 0
    ) -> Iterator[pb.MoveBatch]:
        """The stream (``ps.elastic.moveout``) of this shard's rows that move to shard ``destination``
        of ``to``. Raises ``WrongMode`` on a serving shard, ``Moving`` before the reshard is
        prepared here, ``InvalidRequest`` for a destination that gets nothing from it."""
        self.check_request()
        self.role.refuse_writes("MoveRows")
        alive = self.reshard.alive(active, lambda: self._closing)
        return move_batches(self.reshard, self.tables, self.changes, to, destination, alive, max_bytes, max_rows_per_s)

    def duplicate_pushes(self) -> int:  # pushes skipped as applied before
        return sum(t.ledgers.duplicates for t in self.tables())

    def resident_bytes(self) -> int:
        """What the memory budget is compared with: every table's ``resident_bytes``."""
        return self.budget.resident_bytes()

    # -- storage -------------------------------------------------------------------------

    def flush(self, metadata: bool = True) -> int:
        """Write every table's dirty rows and ledger; returns rows written.
        ``metadata``: see ``Table.flush`` (the interval flush passes False)."""
        started = time.time()
        written = sum(int(self._guard(t.flush, metadata)) for t in self.tables())
        self.last_durable = started
        return written

    def checkpoint(self, path: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
        """A consistent checkpoint of every table: this shard's part of the checkpoint named
        ``path`` (``ps.durability.checkpoint.checkpoint_target``); returns the part's absolute path
        and the manifest written there (see ``ps.durability.checkpoint``).

        Pushes wait (they are not refused) while it is taken. Raises ``ShuttingDown``,
        ``NotConfigured`` without a root, ``InvalidRequest`` for a path that is bad,
        exists or is outside the root, ``StorageFailed`` when the checkpoint cannot be
        written (a failure to write the data dir itself also makes the shard read-only
        until its writes succeed again).
        """
        self.check_request()
        self.role.refuse_writes("Checkpoint")
        with self._checkpoint_lock:
            target = checkpoint_target(self.checkpoint_root, path, self.index, self.num_shards)
            manifest = write_checkpoint(
                target,
                self.tables(),
                self.storage,
                shard=self.index,
                num_shards=self.num_shards,
                data_dir_failed=lambda exc: self._storage_health.failed(str(exc)),
                name=target.parent.name,
                lineage=self.lineage,
            )
            if self.storage is not None:
                self.last_durable = manifest["created_unix_s"]
            return target, manifest

    def load_checkpoint(self, name: str, saved_shards: int, tables: Sequence[str]) -> tuple[dict[str, int], list[Path]]:
        """Make ``tables``' rows here exactly the rows checkpoint ``name`` (written by
        ``saved_shards`` shards) holds for the keys this shard owns (``ps.durability.load``):
        drop every row of those tables, then install the checkpoint's. Returns the rows
        installed per table and the parts read. Followers see every change. Raises
        ``WrongMode`` (serving), ``NotConfigured`` without a root, ``InvalidRequest`` for a
        part, a table or spec that does not match, or while a reshard runs; ``StorageFailed``."""
        self.check_request()
        self.role.refuse_writes("LoadCheckpoint")
        self._storage_health.check()
        if not tables:
            raise InvalidRequest("LoadCheckpoint: tables is empty: name the tables to load")
        mine = {t: self.table(t) for t in tables}
        parts = checkpoint_parts(self.checkpoint_root, name, saved_shards, index=self.index, num_shards=self.num_shards)
        with read_parts(parts, saved_shards) as sources, self.reshard.writing():
            if self.reshard.copying:
                raise InvalidRequest("LoadCheckpoint: a reshard is under way: load once it is done")
            installed = replace_rows(
                mine,
                sources,
                parts,
                index=self.index,
                num_shards=self.num_shards,
                record=self.changes.record,
                install=lambda table, rows: self._guard(table.install_rows, rows),
            )
        log.info("loaded checkpoint %s (%d shards) rows=%s", name, saved_shards, installed)
        return installed, parts

    def expire(self) -> int:
        """Apply every table's TTL now; returns rows deleted."""
        return sum(self._guard(t.expire) for t in self.tables() if t.spec.lifecycle.ttl_seconds)

    @property
    def storage_errors(self) -> int:
        """Storage failures seen since start (failed writes and recovery tries)."""
        return self._storage_health.errors

    def _guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, noting a storage failure on the way out."""
        return self._storage_health.guard(fn, *args, **kwargs)

    def recover_storage(self) -> bool:
        """One try at making failed storage writable again; True if it is (then the
        ``writable`` listeners hear it). The maintenance thread tries with backoff.

        A try reopens RocksDB unless it takes a write as it is, then writes every row
        and ledger entry held back since the failure.
        """
        try:
            self._recover()
        except StorageFailed:
            return False
        return True

    def _recover(self) -> None:
        """``recover_storage``, raising ``StorageFailed`` when the try fails."""
        if self.storage is not None:
            self._storage_health.recover(self._reopen_if_refusing, lambda: self.flush(metadata=False))

    def _reopen_if_refusing(self) -> None:
        if self.storage is not None:
            reopen_if_refusing(self.storage, self._quiesced)

    @contextlib.contextmanager
    def _quiesced(self) -> Iterator[None]:
        """Hold every lock that guards a use of the data dir: no request, spill, flush,
        table creation or checkpoint touches it meanwhile."""
        with self._checkpoint_lock, self._tables.held():
            yield

    # -- background work -----------------------------------------------------------------

    def start(self) -> None:
        """Complete an erase a stop cut short (``ps.shard.erasing``), then start the
        maintenance thread (``ps.shard.maintenance``) and, with a memory budget, the evictor
        thread (``ps.shard.budget``)."""
        if self.role.takes_writes:
            self.erasing.resume()
        self._maintenance.start()
        self.budget.start(self.health, f"ps-shard{self.index}-evict")
        self.reshard.start()

    def close(self) -> None:
        """Refuse new requests from now on (in-flight ones finish)."""
        self._closing = True
        self.changes.wake()

    @property
    def closing(self) -> bool:  # True once ``close`` or ``shutdown`` ran
        return self._closing

    def shutdown(self, grace_s: float = 0.0) -> StopReport:
        """After the last request: stop background work, write what is dirty, close storage.

        If the data dir refuses the final write, keep retrying (with backoff) for
        ``grace_s`` seconds; then, if rows changed by acknowledged pushes are still
        only in RAM (``interval`` and ``checkpoint-only`` modes; ``every-push`` wrote
        each one before acknowledging it), write them to a rescue dump. The report
        says what happened; blocks for up to ``grace_s`` plus the dump's write.

        A serving shard (``role``: ``Serving``) tries the final write once and never
        writes a dump (``ps.durability.rescue``): it acknowledged no push, and its rows come from
        its source (a follower saves the version it reached only once the rows are
        written, so a restart streams again what it could not write).
        """
        self._closing = True
        self.reshard.close()
        self._maintenance.stop()
        self.budget.stop()
        if self.storage is None:
            return StopReport()
        try:
            data = self.storage.path.absolute()
            places = dump_places(data, self.rescue_dir, self.checkpoint_root)
            serving, every_push = not self.role.takes_writes, self.durability.kind == "every-push"
            return self._storage_health.final_write(
                grace_s,
                reopen=self._reopen_if_refusing,
                flush=self.flush,
                at_risk=lambda: None if serving else rows_at_risk(self.tables(), every_push),
                rescue=lambda error: save_rescue(
                    self.tables(), places, (self.index, self.num_shards), data, error, self.rescue_base
                ),
                why_safe=ROWS_FROM_SOURCE if serving else ACKNOWLEDGED_ON_DISK,
            )
        finally:
            self.storage.close()
