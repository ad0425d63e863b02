"""One shard: its tables by name, its mode, its place in the cluster, its data directory.

``Shard`` is what the gRPC servicer talks to, one method per RPC, and what tests drive
without a network. It checks that a request was routed for this cluster's size and
within its ``limits``, validates every entry before anything is applied, runs pushes
through each table's exactly-once ledger, and (with a ``Storage``) keeps the tables
within the memory budget, writes them out as the durability mode says, expires rows,
and takes checkpoints (``ps.checkpoint``).

Modes: a ``train`` shard creates the row of a key on its first lookup, takes pushes, and
numbers both in its change log (``changes``, streamed to followers by ``ps.stream``); a
``serve`` shard reads a key without a row as its default, stores nothing, refuses every
write with ``WrongMode``, and gets its rows from its ``source`` (``ps.follow``).

A storage failure (disk full, I/O error) makes the shard read-only: pushes get
UNAVAILABLE, lookups keep working, nothing is evicted, ``writable`` listeners hear it,
and the maintenance thread retries until the data dir takes writes (``ps.recovery``).
Background loops report each run to ``health`` (``ps.background``). ``shutdown`` writes
every dirty row, retrying for its grace period; rows of acknowledged pushes it still
could not write go to a rescue dump (``ps.rescue``) that its ``StopReport`` names.

Example:
    >>> from ps.config import TableSpec
    >>> shard = Shard(index=0, num_shards=1)
    >>> shard.create_table(TableSpec("item", dim=8))
    True
    >>> request = pb.LookupRequest(entries=[pb.LookupEntry(table="item", keys=wire.encode_keys([3, 4]))])
    >>> wire.decode_lookup_response(shard.lookup(request, max_response_bytes=1 << 20))[0].dim
    8
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import wire
from ps import optimizers
from ps.background import EVICTOR, INTERVAL_FLUSH, STORAGE_RECOVERY, TTL_SWEEP, LoopHealth, RateWindow
from ps.changes import ChangeLog
from ps.checkpoint import next_version_path, require_root, resolve_checkpoint_path, write_checkpoint
from ps.config import Durability, TableSpec, spec_from_proto, spec_to_proto
from ps.errors import (
    InvalidRequest,
    RequestTooLarge,
    ShardMismatch,
    ShuttingDown,
    TableExists,
    UnknownTable,
    WrongMode,
)
from ps.ledger import PushLedger
from ps.lifecycle import Eviction, now_tick
from ps.limits import Limits
from ps.recovery import StorageHealth
from ps.report import RowSource, shard_stats
from ps.rescue import RescueBase, StopReport, dump_places, read_base, save_rescue
from ps.rwlock import ReadWriteLock
from ps.storage import Storage, StorageFailed
from ps.table import Table, held_tables

__all__ = ["MODES", "Mode", "PushLedger", "Shard", "StopReport"]

log = logging.getLogger(__name__)

Mode = Literal["train", "serve"]
MODES: tuple[Mode, ...] = ("train", "serve")

# Above _HIGH_WATER of the budget the evictor thread spills rows down to _LOW_WATER, in
# the background; a request that finds the budget itself exceeded waits for it.
_HIGH_WATER = 0.97
_LOW_WATER = 0.92

# What a Lookup response may need beyond its rows (table names, field headers).
_RESPONSE_OVERHEAD_BYTES = 4096

_DEFAULT_DURABILITY = Durability("interval", 5.0)


class Shard:
    """Tables, mode, cluster identity and storage of one shard. Thread-safe.

    ``storage``: the opened data directory (tables stored there are recreated at
    once; their rows come back from disk when first used). ``memory_budget_bytes``
    (needs storage): resident bytes above which rows are spilled; 0 = no limit.
    ``checkpoint_root``: the only directory checkpoints may be written under (see
    ``ps.checkpoint``); default ``<data dir>/checkpoints``, none without storage.
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
    ) -> None:
        if not 0 <= index < num_shards:
            raise ValueError(f"shard={index}: not in [0, num_shards={num_shards})")
        if memory_budget_bytes and storage is None:
            raise ValueError("memory_budget_bytes needs storage to spill rows to")
        self.index = index
        self.num_shards = num_shards
        self.limits = Limits()  # --max-tables, --max-keys-per-request
        self.eviction: Eviction = "lfu"  # --eviction
        self.mode = mode
        self.storage = storage
        self.durability = durability
        self.memory_budget_bytes = memory_budget_bytes
        # The one place the default root is decided: next to the data, where a
        # checkpoint is hard links; none without a data dir (checkpoints are refused).
        if checkpoint_root is None and storage is not None:
            checkpoint_root = storage.path / "checkpoints"
        self.checkpoint_root = Path(checkpoint_root).absolute() if checkpoint_root is not None else None
        self.rescue_dir: Path | None = None  # --rescue-dir, tried first (``ps.rescue.dump_places``)
        self.rescue_base = read_base(storage) if storage is not None else RescueBase()  # noted in a dump
        self.health = LoopHealth()
        self.started = time.monotonic()
        self.last_durable = time.time()
        self._storage_health = StorageHealth(index)
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._closing = False
        self.rates = RateWindow()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._evictor: threading.Thread | None = None
        self._wake_evictor = threading.Event()
        self.changes = ChangeLog()  # a training shard's versions, for serving shards that follow it
        # A serving shard's lookups read under it, together; whatever swaps or changes its
        # rows (``ps.follow``) writes under it, so a lookup sees a change batch whole or not at all.
        self.serve_lock = ReadWriteLock()
        self.source: RowSource | None = None  # a serving shard's source of rows: in stats() and health
        if storage is not None:
            for name, blob in sorted(storage.specs().items()):
                self._tables[name] = self._new_table(spec_from_proto(pb.TableSpec.FromString(blob)))
            if self._tables:
                log.info("reopened %d tables from %s: %s", len(self._tables), storage.path, ", ".join(self._tables))

    @property
    def mode(self) -> Mode:
        """``"train"`` or ``"serve"``; may be switched while the shard runs (a request reads
        it once, so one in flight finishes in the mode it read)."""
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
        self._mode = mode

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

    def _new_table(self, spec: TableSpec) -> Table:
        if self.storage is None:
            return Table(spec)
        rows = self.storage.table(spec.name, spec.dim, optimizers.state_width(spec.optimizer, spec.dim))
        every_push, failed = self.durability.kind == "every-push", self._storage_health.failed
        return Table(spec, rows=rows, storage=self.storage, every_push=every_push, on_write_failure=failed)

    # -- tables --------------------------------------------------------------------------

    def create_table(self, spec: TableSpec) -> bool:
        """Create ``spec``'s table; False if an identical one exists.

        Raises ``WrongMode`` on a serving shard, ``TableExists`` naming every differing
        field if the name is taken by another spec, ``StorageFailed`` if the spec cannot
        be stored.
        """
        self.check_mode("CreateTable")
        return self.install_table(spec, limited=True)

    def install_table(self, spec: TableSpec, limited: bool = False) -> bool:
        """``create_table`` in any mode: how a serving shard takes its leader's tables
        (``limited``: a new one must fit ``limits.max_tables``)."""
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is None and limited:
                self.limits.check_new_table(self.index, len(self._tables))
            if existing is not None:
                diff = existing.spec.differences(spec)
                if diff:
                    raise TableExists(
                        f"table {spec.name!r} exists with a different spec: {'; '.join(diff)} (existing != requested)"
                    )
                return False
            if self.storage is not None:
                self._storage_health.check()
                self._guard(self.storage.save_spec, spec.name, spec_to_proto(spec).SerializeToString())
            self._tables[spec.name] = self._new_table(spec)
        log.info("table created name=%s dim=%d optimizer=%s", spec.name, spec.dim, spec.optimizer.kind.name)
        return True

    def table(self, name: str) -> Table:
        """The table called ``name``; raises ``UnknownTable`` listing the ones that exist."""
        try:
            return self._tables[name]
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise UnknownTable(f"table {name!r} does not exist on shard {self.index} (tables: {known})") from None

    def swap_tables(self, tables: dict[str, Table]) -> dict[str, Table]:
        """Serve ``tables`` from now on; returns the ones served until now (``ps.follow``)."""
        with self._lock:
            previous, self._tables = self._tables, tables
        return previous

    def tables(self) -> list[Table]:
        """Every table, sorted by name."""
        with self._lock:
            return [self._tables[n] for n in sorted(self._tables)]

    def specs(self) -> list[TableSpec]:
        """The spec of every table, sorted by name."""
        return [t.spec for t in self.tables()]

    def check_request(self, num_shards: int, shard: int | None = None) -> None:
        """Raise unless a request routed for ``num_shards`` shards (to ``shard``) may run here now."""
        if self._closing:
            raise ShuttingDown(f"shard {self.index} is shutting down")
        if shard is not None and shard != self.index:
            raise ShardMismatch(
                f"request for shard {shard} reached shard {self.index}: the client's address list is not in shard order"
            )
        if num_shards and num_shards != self.num_shards:
            raise ShardMismatch(
                f"request was routed for num_shards={num_shards}, but shard {self.index} belongs to a "
                f"cluster of {self.num_shards}: the client's address list does not match the cluster"
            )

    def check_writable(self) -> None:
        """Raise ``WrongMode`` if this shard refuses pushes (serving mode), ``StorageFailed``
        if its storage failed."""
        self.check_mode("Push")
        self._storage_health.check()

    def check_mode(self, what: str) -> None:
        """Raise ``WrongMode`` naming ``what`` and the mode unless this is a training shard."""
        if self._mode != "train":
            raise WrongMode(
                f"{what} refused: shard {self.index} is read-only (mode={self._mode}); "
                "send writes to the training shard it serves from"
            )

    @staticmethod
    def check_table_field(name: str, field: str) -> None:
        """Raise ``InvalidRequest`` if a request entry has no table name."""
        if not name:
            raise InvalidRequest(f"{field}: table name is empty")

    def _entry_table(self, name: str, i: int) -> Table:
        self.check_table_field(name, f"entries[{i}].table")
        return self.table(name)

    # -- requests ------------------------------------------------------------------------

    def lookup(self, request: pb.LookupRequest, max_response_bytes: int) -> bytes:
        """The encoded ``LookupResponse`` to ``request``: every entry is checked and the
        response sized first, then each table's rows are gathered straight into it.

        Training mode creates the rows of missing keys; serving mode reads them as zeros
        and stores nothing, and notes a row's use only where a memory budget evicts by
        it. Raises ``ShuttingDown``, ``ShardMismatch``, ``InvalidRequest`` or
        ``WireFormatError`` (naming the entry and field), ``UnknownTable``, ``RequestTooLarge``
        (a response over ``max_response_bytes``); ``StorageFailed`` if disk reads fail."""
        self.check_request(request.num_shards, request.shard if request.HasField("shard") else None)
        # A serving shard's rows change only in whole batches (and its tables may be
        # swapped for a checkpoint's): it answers under the lock those changes take.
        with self.serve_lock.reading() if self._mode != "train" else contextlib.nullcontext():
            return self._lookup(request, max_response_bytes)

    def _lookup(self, request: pb.LookupRequest, max_response_bytes: int) -> bytes:
        self.limits.check_keys("Lookup", (len(e.keys) // 8 for e in request.entries))
        plan: list[tuple[Table, npt.NDArray[np.int64], int]] = []
        total = 0
        for i, entry in enumerate(request.entries):
            table = self._entry_table(entry.table, i)
            keys = wire.decode_keys(entry.keys, f"entries[{i}].keys (table {entry.table!r})")
            dtype = entry.dtype or wire.FLOAT32
            total += keys.shape[0] * table.dim * wire.dtype_itemsize(dtype, f"entries[{i}].dtype")
            plan.append((table, keys, dtype))
        if total > max_response_bytes - _RESPONSE_OVERHEAD_BYTES:
            raise RequestTooLarge(
                f"Lookup response would be {total} bytes, over this shard's max_message_bytes="
                f"{max_response_bytes}: send fewer keys per request"
            )
        writer = wire.LookupResponseWriter([(t.spec.name, k.shape[0], t.dim, dt) for t, k, dt in plan])
        create = self._mode == "train"
        touch = create or self.memory_budget_bytes > 0  # TTLs expire rows in training mode only
        created: list[tuple[str, npt.NDArray[np.int64]]] = []
        for i, (table, keys, dtype) in enumerate(plan):
            out, before = writer.rows(i), table.counters.rows_created
            if dtype == wire.FLOAT32:
                table.lookup(keys, cast("npt.NDArray[np.float32]", out), create=create, touch=touch)
            else:
                out[:] = wire.rows_to_dtype(table.lookup(keys, create=create, touch=touch), dtype)
            if table.counters.rows_created != before:  # new rows: followers must see them too
                created.append((table.spec.name, keys.copy()))
        if created:
            self.changes.record(created)
        self.after_request()
        return writer.finish()

    def push(self, request: wire.PushRequestView) -> tuple[bool, int]:
        """Apply ``request`` once per ``(client_id, seq)`` and table; returns (applied
        anywhere, distinct rows updated). Every entry is checked before any is applied.

        Raises ``ShuttingDown``, ``ShardMismatch``, ``WrongMode`` (serving mode),
        ``StorageFailed`` (storage failed: nothing applied), ``InvalidRequest`` or
        ``WireFormatError`` (naming the entry and field), ``UnknownTable``.
        """
        self.check_request(request.num_shards, request.shard)
        self.check_writable()
        self.limits.check_keys("Push", (len(e.keys) // 8 for e in request.entries))
        batch = []
        for i, entry in enumerate(request.entries):
            table = self._entry_table(entry.table, i)
            field = f"entries[{i}] (table {entry.table!r})"
            keys = wire.decode_keys(entry.keys, f"{field}.keys")
            grads = wire.decode_rows(entry.grads, keys.shape[0], table.dim, entry.dtype, f"{field}.grads")
            table.validate_grads(keys, grads)
            batch.append((table, keys, grads))
        applied, rows = False, 0
        changed = []
        for table, keys, grads in batch:
            n = self._guard(table.push, keys, grads, client_id=request.client_id, seq=request.seq, check=False)
            if n is not None:
                applied, rows = True, rows + n
                changed.append((table.spec.name, keys.copy()))  # a copy: the view would keep the request
        if changed:
            self.changes.record(changed)
        if self.durability.kind == "every-push" and self.storage is not None:
            self.last_durable = time.time()
        self.after_request()
        return applied, rows

    def after_request(self) -> None:
        """Keep the tables within the memory budget: wake the evictor thread as they near
        it; spill here, or wait for the evictor, beyond it (``lookup`` and ``push`` call it).
        Never raises ``StorageFailed``: the request it follows was applied (and must be
        acknowledged); a spill that fails turns the shard read-only for the next ones."""
        if not (self.memory_budget_bytes and self.writable):
            return
        used = self.resident_bytes()
        if used > self.memory_budget_bytes:
            with contextlib.suppress(StorageFailed):  # recorded by _guard
                self.enforce_budget()
        elif used > _HIGH_WATER * self.memory_budget_bytes and self._evictor is not None:
            self._wake_evictor.set()

    def stats(self) -> pb.StatsResponse:
        return shard_stats(self)  # counters of the shard and every table, failing loops, source

    def duplicate_pushes(self) -> int:  # pushes skipped as applied before
        return sum(t.ledger.duplicates for t in self.tables())

    def resident_bytes(self) -> int:
        """What the memory budget is compared with: every table's ``resident_bytes``."""
        return sum(t.resident_bytes() for t in self.tables())

    # -- storage -------------------------------------------------------------------------

    def enforce_budget(self) -> int:
        """Spill rows in ``eviction`` order, across tables, down to ``_LOW_WATER`` of the
        budget; returns rows moved. One thread at a time (others wait, then see what is left)."""
        with self._evict_lock:
            tables = self.tables()
            need = self.resident_bytes() - int(_LOW_WATER * self.memory_budget_bytes)
            if need <= 0 or not self.writable:
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

    def flush(self, metadata: bool = True) -> int:
        """Write every table's dirty rows and ledger; returns rows written.
        ``metadata``: see ``Table.flush`` (the interval flush passes False)."""
        started = time.time()
        written = sum(int(self._guard(t.flush, metadata)) for t in self.tables())
        self.last_durable = started
        return written

    def checkpoint(self, path: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
        """A consistent checkpoint of every table at ``path`` (under ``checkpoint_root``;
        relative paths resolve under it; default: ``<root>/<next version>``); returns the
        absolute path and the manifest written there (see ``ps.checkpoint``).

        Pushes wait (they are not refused) while it is taken. Raises ``ShuttingDown``,
        ``NotConfigured`` without a root, ``InvalidRequest`` for a path that is bad,
        exists or is outside the root, ``StorageFailed`` when the checkpoint cannot be
        written (a failure to write the data dir itself also makes the shard read-only
        until its writes succeed again).
        """
        self.check_request(0)
        self.check_mode("Checkpoint")
        with self._checkpoint_lock:
            if path is None or str(path) == "":
                path = next_version_path(require_root(self.checkpoint_root, self.index).resolve())
            target = resolve_checkpoint_path(self.checkpoint_root, str(path), self.index)
            manifest = write_checkpoint(
                target,
                self.tables(),
                self.storage,
                shard=self.index,
                num_shards=self.num_shards,
                data_dir_failed=lambda exc: self._storage_health.failed(str(exc)),
            )
            if self.storage is not None:
                self.last_durable = manifest["created_unix_s"]
            return target, manifest

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
        """Reopen the data dir's RocksDB unless a probe write goes through as it is."""
        if self.storage is None:
            return
        try:
            self.storage.probe()
            return
        except StorageFailed:
            pass
        with self._quiesced():
            self.storage.reopen()

    @contextlib.contextmanager
    def _quiesced(self) -> Iterator[None]:
        """Hold every lock that guards a use of the data dir: no request, spill, flush,
        table creation or checkpoint touches it meanwhile."""
        with self._checkpoint_lock, self._lock, held_tables(list(self._tables.values())):
            yield

    # -- background work -----------------------------------------------------------------

    def start(self) -> None:
        """Start the maintenance thread (interval flushes, TTL sweeps, storage recovery,
        rate samples) and, with a memory budget, the evictor thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._maintain, name=f"ps-shard{self.index}-maint", daemon=True)
            self._thread.start()
        if self._evictor is None and self.memory_budget_bytes:
            self._evictor = threading.Thread(target=self._evict_loop, name=f"ps-shard{self.index}-evict", daemon=True)
            self._evictor.start()

    def _evict_loop(self) -> None:
        while not self._stop.is_set():
            self._wake_evictor.wait(0.5)
            self._wake_evictor.clear()
            if self._stop.is_set() or not self.writable:
                continue
            with self.health.run(EVICTOR):
                if self.resident_bytes() > _HIGH_WATER * self.memory_budget_bytes:
                    self.enforce_budget()

    def _maintain(self) -> None:
        last_flush = last_ttl = time.monotonic()
        while not self._stop.wait(0.25):
            now = time.monotonic()
            self.rates.sample(
                now, {t.spec.name: (t.counters.rows_spilled, t.counters.rows_faulted_in) for t in self.tables()}
            )
            if self.storage is not None and not self.writable:
                if self._storage_health.retry_due(now):
                    with self.health.run(STORAGE_RECOVERY):
                        self._recover()
                    if self.writable:  # run the other loops now: a failure of theirs clears at once
                        last_flush = last_ttl = -math.inf
                continue
            interval = self.durability.kind == "interval" and self.storage is not None
            if interval and now - last_flush >= self.durability.interval_s:
                last_flush = now
                with self.health.run(INTERVAL_FLUSH):
                    self.flush(metadata=False)
            ttls = [t.spec.lifecycle.ttl_seconds for t in self.tables() if t.spec.lifecycle.ttl_seconds]
            if (
                ttls
                and now - last_ttl >= max(0.5, min(60.0, min(ttls) / 4))
                and self.writable
                and self._mode == "train"
            ):
                last_ttl = now
                with self.health.run(TTL_SWEEP):
                    self.expire()

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
        """
        self._closing = True
        self._stop.set()
        self._wake_evictor.set()
        for thread in (self._thread, self._evictor):
            if thread is not None:
                thread.join(timeout=30)
        if self.storage is None:
            return StopReport()
        try:
            data = self.storage.path.absolute()
            return self._storage_health.final_write(
                grace_s,
                reopen=self._reopen_if_refusing,
                flush=self.flush,
                at_risk=self._at_risk,
                rescue=lambda error: self._rescue(data, error),
            )
        finally:
            self.storage.close()

    def _at_risk(self) -> int | None:
        """Rows changed by acknowledged pushes only in RAM (None: none, and no ledger entry
        either). In every-push mode each was written before it was acknowledged."""
        tables = self.tables()
        unwritten = sum(t.unpersisted_rows() for t in tables)
        if self.durability.kind == "every-push" or not (unwritten or any(t.ledger.has_changes() for t in tables)):
            return None
        return unwritten

    def _rescue(self, data: Path, error: str) -> StopReport:
        """Save what data dir ``data`` could not take to the first rescue place that works."""
        places = dump_places(data, self.rescue_dir, self.checkpoint_root)
        return save_rescue(self.tables(), places, (self.index, self.num_shards), data, error, self.rescue_base)
