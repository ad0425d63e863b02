"""One shard: its tables by name, its place in the cluster, its data directory.

``Shard`` is what the gRPC servicer talks to, and what tests can drive without a
network. It checks that a request was routed for this cluster's size, resolves table
names, runs pushes through each table's exactly-once ledger, and (with a
``Storage``) keeps the tables within the memory budget, writes them out as the
durability mode says, expires rows, and takes checkpoints.

A storage failure (disk full, I/O error) makes the shard read-only: pushes get
UNAVAILABLE, lookups keep working, nothing is evicted any more (RAM may grow past the
budget rather than drop a row it cannot write), and ``writable`` listeners hear it
(the server flips a health status). The maintenance thread then retries, with
backoff (0.5 s doubling to 5 s): it reopens RocksDB (which refuses every write after
a failed one) and writes what was held back; once that succeeds the shard is
writable again and the listeners hear that too. Nothing needs a restart.

Stopping (``shutdown``) writes every dirty row. If the data dir refuses that, the
shard keeps retrying for its grace period; then, if rows changed by acknowledged
pushes are still only in RAM, it saves them to a rescue dump (``ps.rescue``) in its
checkpoint root or next to the data dir, and the returned ``StopReport`` says where
(or that even that failed).

Example:
    >>> from ps.config import TableSpec
    >>> shard = Shard(index=0, num_shards=1)
    >>> shard.create_table(TableSpec("item", dim=8))
    True
    >>> shard.table("item").dim
    8
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf import json_format

from protos import ps_pb2 as pb
from ps import optimizers
from ps.config import Durability, TableSpec, spec_from_proto, spec_to_proto
from ps.checkpoint import next_version_path, require_root, resolve_checkpoint_path
from ps.errors import InvalidRequest, ShardMismatch, ShuttingDown, TableExists, UnknownTable, WrongMode
from ps.ledger import PushLedger
from ps.lifecycle import now_tick
from ps.rescue import StopReport, save_rescue
from ps.storage import FORMAT_VERSION, Storage, StorageFailed, write_manifest
from ps.table import Table

__all__ = ["PushLedger", "Shard", "StopReport"]

log = logging.getLogger(__name__)

# Retries of a failed storage: the first after _RETRY_FIRST_S, then twice as long each
# time up to _RETRY_MAX_S (each try reopens RocksDB, which replays its write-ahead log).
_RETRY_FIRST_S = 0.5
_RETRY_MAX_S = 5.0

# Above _HIGH_WATER of the budget the evictor thread spills rows down to _LOW_WATER, in
# the background; a request that finds the budget itself exceeded waits for it.
_HIGH_WATER = 0.97
_LOW_WATER = 0.92
_RATE_WINDOW_S = 10.0


class Shard:
    """Tables, cluster identity and storage of one shard. Thread-safe.

    ``storage``: the opened data directory (tables stored there are recreated at
    once; their rows come back from disk when first used). ``memory_budget_bytes``
    (needs storage): resident bytes above which rows are spilled; 0 = no limit.
    ``checkpoint_root``: the only directory checkpoints may be written under (see
    ``ps.checkpoint``); default ``<data dir>/checkpoints``, none without storage.
    """

    def __init__(
        self,
        index: int,
        num_shards: int,
        storage: Storage | None = None,
        durability: Durability = Durability("interval", 5.0),
        memory_budget_bytes: int = 0,
        checkpoint_root: Path | None = None,
    ) -> None:
        if not 0 <= index < num_shards:
            raise ValueError(f"shard={index}: not in [0, num_shards={num_shards})")
        if memory_budget_bytes and storage is None:
            raise ValueError("memory_budget_bytes needs storage to spill rows to")
        self.index = index
        self.num_shards = num_shards
        self.mode = "train"
        self.storage = storage
        self.durability = durability
        self.memory_budget_bytes = memory_budget_bytes
        # The one place the default root is decided: next to the data, where a
        # checkpoint is hard links; none without a data dir (checkpoints are refused).
        if checkpoint_root is None and storage is not None:
            checkpoint_root = storage.path / "checkpoints"
        self.checkpoint_root = Path(checkpoint_root).absolute() if checkpoint_root is not None else None
        self.started = time.monotonic()
        self.writable = True
        self.storage_error = ""
        self.last_durable = time.time()
        self._failed_at = 0.0
        self._retry_at = 0.0
        self._retry_delay_s = _RETRY_FIRST_S
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._closing = False
        self._listeners: list[Callable[[bool], None]] = []
        self._rates: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._evictor: threading.Thread | None = None
        self._wake_evictor = threading.Event()
        if storage is not None:
            for name, blob in sorted(storage.specs().items()):
                self._tables[name] = self._new_table(spec_from_proto(pb.TableSpec.FromString(blob)))
            if self._tables:
                log.info("reopened %d tables from %s: %s", len(self._tables), storage.path, ", ".join(self._tables))

    def _new_table(self, spec: TableSpec) -> Table:
        if self.storage is None:
            return Table(spec)
        rows = self.storage.table(spec.name, spec.dim, optimizers.state_width(spec.optimizer, spec.dim))
        return Table(spec, rows=rows, storage=self.storage, every_push=self.durability.kind == "every-push")

    # -- tables --------------------------------------------------------------------------

    def create_table(self, spec: TableSpec) -> bool:
        """Create ``spec``'s table; False if an identical one exists.

        Raises ``TableExists`` naming every differing field if the name is taken by
        another spec; ``StorageFailed`` if the spec cannot be stored.
        """
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                diff = existing.spec.differences(spec)
                if diff:
                    raise TableExists(
                        f"table {spec.name!r} exists with a different spec: {'; '.join(diff)} "
                        "(existing != requested)"
                    )
                return False
            if self.storage is not None:
                self.check_writable()
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

    def tables(self) -> list[Table]:
        """Every table, sorted by name."""
        with self._lock:
            return [self._tables[n] for n in sorted(self._tables)]

    def check_request(self, num_shards: int, shard: int | None = None) -> None:
        """Raise unless a request routed for ``num_shards`` shards (to ``shard``) may run here now."""
        if self._closing:
            raise ShuttingDown(f"shard {self.index} is shutting down")
        if shard is not None and shard != self.index:
            raise ShardMismatch(
                f"request for shard {shard} reached shard {self.index}: the client's address list "
                "is not in shard order"
            )
        if num_shards and num_shards != self.num_shards:
            raise ShardMismatch(
                f"request was routed for num_shards={num_shards}, but shard {self.index} belongs to a "
                f"cluster of {self.num_shards}: the client's address list does not match the cluster"
            )

    def check_writable(self) -> None:
        """Raise ``WrongMode`` if this shard refuses pushes (serving mode), ``StorageFailed``
        if its storage failed."""
        if self.mode != "train":
            raise WrongMode(f"shard {self.index} is read-only (mode={self.mode}): pushes are refused")
        if not self.writable:
            raise StorageFailed(
                f"shard {self.index} refuses writes since its storage failed ({self.storage_error}); "
                "lookups still work. It retries by itself and takes pushes again once its writes succeed: "
                "free space or fix the data dir, then retry the push"
            )

    @staticmethod
    def check_table_field(name: str, field: str) -> None:
        """Raise ``InvalidRequest`` if a request entry has no table name."""
        if not name:
            raise InvalidRequest(f"{field}: table name is empty")

    # -- requests ------------------------------------------------------------------------

    def push(
        self, entries: list[tuple[Table, npt.NDArray[np.int64], npt.NDArray[np.float32]]], client_id: str, seq: int
    ) -> tuple[bool, int]:
        """Apply validated ``(table, keys, grads)`` entries once per ``(client_id, seq)``
        and table; returns (applied anywhere, rows updated)."""
        self.check_writable()
        applied, rows = False, 0
        for table, keys, grads in entries:
            n = self._guard(table.push, keys, grads, client_id=client_id, seq=seq, check=False)
            if n is not None:
                applied, rows = True, rows + n
        if self.durability.kind == "every-push" and self.storage is not None:
            self.last_durable = time.time()
        self.after_request()
        return applied, rows

    def after_request(self) -> None:
        """Keep the tables within the memory budget (called after each request): wake the
        evictor thread as they near it; spill here, or wait for the evictor, beyond it.

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

    def duplicate_pushes(self) -> int:
        return sum(t.ledger.duplicates for t in self.tables())

    def resident_bytes(self) -> int:
        """What the memory budget is compared with: every table's ``resident_bytes``."""
        return sum(t.resident_bytes() for t in self.tables())

    # -- storage -------------------------------------------------------------------------

    def enforce_budget(self) -> int:
        """Spill least recently used rows, across all tables, until resident bytes are at
        ``_LOW_WATER`` of the budget; returns rows moved. One thread at a time (others
        wait for it, then see what is left to do)."""
        with self._evict_lock:
            tables = self.tables()
            need = self.resident_bytes() - int(_LOW_WATER * self.memory_budget_bytes)
            if need <= 0 or not self.writable:
                return 0
            now = now_tick()
            hists = [t.age_histogram(now) for t in tables]
            weights = [t.bytes_per_row for t in tables]
            by_age = sum((h * w for h, w in zip(hists, weights, strict=True)), np.zeros_like(hists[0]))
            from_oldest = np.cumsum(by_age[::-1])
            j = min(int(np.searchsorted(from_oldest, need)), by_age.shape[0] - 1)
            cutoff = by_age.shape[0] - 1 - j  # evict every row older than this age ...
            older = int(from_oldest[j - 1]) if j > 0 else 0
            share = (need - older) / by_age[cutoff] if by_age[cutoff] else 0.0  # ... and this share of it
            moved = 0
            for t, h in zip(tables, hists, strict=True):
                count = int(h[cutoff + 1 :].sum()) + math.ceil(h[cutoff] * min(1.0, share))
                if count:
                    # Rows only get younger meanwhile, so h still bounds the victims.
                    moved += self._guard(t.evict, count, now, h)
            return moved

    def flush(self, metadata: bool = True) -> int:
        """Write every table's dirty rows and ledger; returns rows written.
        ``metadata``: see ``Table.flush`` (the interval flush passes False)."""
        started = time.time()
        written = sum(self._guard(t.flush, metadata) for t in self.tables())
        self.last_durable = started
        return written

    def checkpoint(self, path: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
        """A consistent checkpoint of every table at ``path`` (under ``checkpoint_root``;
        relative paths resolve under it; default: ``<root>/<next version>``); returns the
        absolute path and the manifest written there.

        Pushes wait (they are not refused) while the tables are flushed and the RocksDB
        checkpoint is taken. A shard without a data dir writes its rows into a new one
        at ``path``. Raises ``NotConfigured`` without a root, ``InvalidRequest`` for a
        path that is bad, exists or is outside the root, ``StorageFailed`` when the
        checkpoint cannot be written (a failure to write the data dir itself also
        makes the shard read-only until its writes succeed again).
        """
        with self._checkpoint_lock:
            tables = self.tables()
            if path is None or str(path) == "":
                path = next_version_path(require_root(self.checkpoint_root, self.index).resolve())
            path = resolve_checkpoint_path(self.checkpoint_root, str(path), self.index)
            manifest: dict[str, Any] = {
                "format": FORMAT_VERSION,
                "shard": self.index,
                "num_shards": self.num_shards,
                "version": path.name,
                "created_unix_s": time.time(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "tables": [json_format.MessageToDict(spec_to_proto(t.spec)) for t in tables],
            }
            existed = os.path.lexists(path)
            try:
                if self.storage is None:
                    self._checkpoint_from_ram(path, tables, manifest)
                    return path, manifest
                with contextlib.ExitStack() as held:
                    for t in tables:  # sorted by name: every thread takes them in one order
                        held.enter_context(t._lock)
                    for t in tables:
                        self._guard(t._flush_locked, True)
                    manifest["rows"] = {t.spec.name: len(t) + t.spilled for t in tables}
                    # Not guarded: a checkpoint directory that cannot be written does not
                    # make the data dir read-only.
                    self.storage.checkpoint(path, manifest)
            except BaseException:
                if not existed:
                    _remove_partial(path)
                raise
            self.last_durable = manifest["created_unix_s"]
            log.info("checkpoint written path=%s tables=%d", path, len(tables))
            return path, manifest

    def _checkpoint_from_ram(self, path: Path, tables: list[Table], manifest: dict[str, Any]) -> None:
        rows: dict[str, int] = {}
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            raise StorageFailed(f"cannot create checkpoint directory {path}: {exc.strerror}") from None
        with Storage(path, shard=self.index, num_shards=self.num_shards) as out:
            for t in tables:
                out.save_spec(t.spec.name, spec_to_proto(t.spec).SerializeToString())
                target = out.table(t.spec.name, t.dim, optimizers.state_width(t.spec.optimizer, t.dim))
                rows[t.spec.name] = t.write_to(target, out)
            out.flush_memtables()
        (path / "ps.lock").unlink(missing_ok=True)
        manifest["rows"] = rows
        write_manifest(path, manifest)

    def expire(self) -> int:
        """Apply every table's TTL now; returns rows deleted."""
        return sum(self._guard(t.expire) for t in self.tables() if t.spec.lifecycle.ttl_seconds)

    def _guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, noting a storage failure on the way out."""
        try:
            return fn(*args, **kwargs)
        except StorageFailed as exc:
            self._storage_failed(str(exc))
            raise

    def _storage_failed(self, error: str) -> None:
        if not self.writable:
            return
        self.writable = False
        self.storage_error = error
        self._failed_at = time.monotonic()
        self._retry_delay_s = _RETRY_FIRST_S
        self._retry_at = self._failed_at + _RETRY_FIRST_S
        log.error("storage failed, refusing writes (reads continue); retrying in the background: %s", error)
        self._tell_listeners(False)

    def _tell_listeners(self, writable: bool) -> None:
        for listener in list(self._listeners):
            listener(writable)

    def recover_storage(self) -> bool:
        """One try at making failed storage writable again; True if it is (then the
        ``writable`` listeners hear it). The maintenance thread calls this with backoff.

        A try reopens RocksDB unless it takes a write as it is, then writes every row
        and ledger entry held back since the failure.
        """
        if self.storage is None or self.writable:
            return True
        try:
            self._reopen_if_refusing()
            written = self.flush(metadata=False)
        except StorageFailed as exc:
            self.storage_error = str(exc)
            self._retry_delay_s = min(2 * self._retry_delay_s, _RETRY_MAX_S)
            self._retry_at = time.monotonic() + self._retry_delay_s
            log.warning("storage still failing, next try in %.1f s: %s", self._retry_delay_s, exc)
            return False
        self.writable = True
        self.storage_error = ""
        log.warning(
            "storage writable again after %.1f s: wrote %d rows held back meanwhile; taking pushes again",
            time.monotonic() - self._failed_at,
            written,
        )
        self._tell_listeners(True)
        return True

    def _reopen_if_refusing(self) -> None:
        """Reopen the data dir's RocksDB unless a probe write goes through as it is."""
        assert self.storage is not None
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
        with self._checkpoint_lock, self._lock, contextlib.ExitStack() as held:
            for name in sorted(self._tables):  # the order every other thread takes them in
                table = self._tables[name]
                held.enter_context(table._lock)
                held.enter_context(table._write_lock)
            yield

    def on_writable_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(writable)`` when the shard starts or stops accepting writes."""
        self._listeners.append(listener)

    # -- background work -----------------------------------------------------------------

    def start(self) -> None:
        """Start the maintenance thread (interval flushes, TTL sweeps, rate samples) and,
        with a memory budget, the evictor thread."""
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
            try:
                if self.resident_bytes() > _HIGH_WATER * self.memory_budget_bytes:
                    self.enforce_budget()
            except StorageFailed:
                pass  # already reported by _guard
            except Exception:
                log.exception("eviction failed")

    def _maintain(self) -> None:
        last_flush = last_ttl = time.monotonic()
        while not self._stop.wait(0.25):
            now = time.monotonic()
            self._sample_rates(now)
            if self.storage is not None and not self.writable and now >= self._retry_at:
                try:
                    self.recover_storage()
                except Exception:
                    log.exception("storage recovery failed")
                continue
            try:
                if (
                    self.storage is not None
                    and self.durability.kind == "interval"
                    and self.writable
                    and now - last_flush >= self.durability.interval_s
                ):
                    last_flush = now
                    self.flush(metadata=False)
                ttls = [t.spec.lifecycle.ttl_seconds for t in self.tables() if t.spec.lifecycle.ttl_seconds]
                if ttls and now - last_ttl >= max(0.5, min(60.0, min(ttls) / 4)) and self.writable:
                    last_ttl = now
                    self.expire()
            except StorageFailed:
                pass  # already reported by _guard
            except Exception:
                log.exception("maintenance step failed")

    def _sample_rates(self, now: float) -> None:
        counts = {t.spec.name: (t.counters.rows_spilled, t.counters.rows_faulted_in) for t in self.tables()}
        self._rates.append((now, counts))
        while len(self._rates) > 2 and now - self._rates[0][0] > _RATE_WINDOW_S:
            self._rates.popleft()

    def rates(self, table: str) -> tuple[float, float]:
        """(rows spilled per second, rows faulted in per second) of ``table`` over the last ~10 s."""
        if len(self._rates) < 2:
            return 0.0, 0.0
        (t0, c0), (t1, c1) = self._rates[0], self._rates[-1]
        s0, f0 = c0.get(table, (0, 0))
        s1, f1 = c1.get(table, (0, 0))
        dt = max(t1 - t0, 1e-9)
        return (s1 - s0) / dt, (f1 - f0) / dt

    def close(self) -> None:
        """Refuse new requests from now on (in-flight ones finish)."""
        self._closing = True

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
            return self._final_write(grace_s)
        finally:
            self.storage.close()

    def _final_write(self, grace_s: float) -> StopReport:
        deadline = time.monotonic() + grace_s
        delay = _RETRY_FIRST_S
        while True:
            try:
                if not self.writable:
                    self._reopen_if_refusing()
                written = self.flush()
                log.info("final flush wrote %d rows", written)
                return StopReport()
            except StorageFailed as exc:
                self._storage_failed(str(exc))
                error = str(exc)
            tables = self.tables()
            unwritten = sum(t.unpersisted_rows() for t in tables)
            at_risk = self.durability.kind != "every-push" and (unwritten or any(t.ledger.has_changes() for t in tables))
            if not at_risk:
                log.warning(
                    "final flush failed (%s), but every acknowledged push is on disk: what was not written is "
                    "rows created by lookups (they come back identical) and access times", error
                )
                return StopReport(error=error)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            log.warning(
                "final flush failed, %d rows changed by acknowledged pushes are only in RAM; retrying in %.1f s "
                "(grace period ends in %.1f s): %s", unwritten, min(delay, left), left, error,
            )  # fmt: skip
            time.sleep(min(delay, left))  # the last try is at the end of the grace period
            delay = min(2 * delay, _RETRY_MAX_S)
        return self._rescue(error)

    def _rescue(self, error: str) -> StopReport:
        """Save what the data dir could not take to the first rescue location that works."""
        assert self.storage is not None
        data = self.storage.path.absolute()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
        places = [self.checkpoint_root / f"rescue-{stamp}"] if self.checkpoint_root is not None else []
        places.append(data.parent / f"{data.name}.rescue-{stamp}")
        return save_rescue(self.tables(), places, shard=self.index, num_shards=self.num_shards, data_dir=data, error=error)


def _remove_partial(path: Path) -> None:
    """Remove what a failed checkpoint left at ``path`` (which did not exist before it)."""
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)
