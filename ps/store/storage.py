"""A shard's data directory: RocksDB (via rocksdict, raw bytes only) holding cold rows,
table specs and push ledgers, plus checkpoints.

Layout of a data directory::

    DIR/ps.lock          flock()ed by the one process that has DIR open (holds its pid)
    DIR/db/              RocksDB: column family "meta", and "t:<table>" per table
    DIR/checkpoints/N/   checkpoints taken by the Checkpoint RPC (db/ + manifest.json)

A checkpoint directory has the same ``db/`` plus ``manifest.json``, so a shard can be
started from it (``ps-server --restore-from``) and ``ps-admin reshard`` can read it.

Rows are stored one per key: RocksDB key = the int64 key big-endian (8 bytes), value =
the row in its stored form (``ps.store.rows.Rows.packed``): ``values`` and optimizer ``state``
in the table's storage types, then the row's version (16-bit tables only),
``last_access`` and ``frequency`` (uint32 each), all little-endian
(``RowFormat.record_bytes``: ``4 * (dim + state_width + 2)`` for float32). ``meta``
holds ``identity`` (format, shard, num_shards), ``spec:<table>`` (the TableSpec
protobuf) and ``ledger:<table>\\0<client_id>`` (that client's applied push seqs on that
table; see ``ps.table.ledger``).

rocksdict's API takes and returns one ``bytes`` per key, so this tier builds one per
row it reads or writes (through numpy's C loops, never a Python loop per key); RAM
hits never come here. A multi-get releases the GIL, so a large one is split across a
few reader threads: a point read costs RocksDB microseconds of CPU (filter, index and
block searches), and a fault-in of thousands of rows is the tier's critical path. A
write (which, in rocksdict, holds the GIL) is one WriteBatch, atomic, with the WAL on;
a failed write raises ``StorageFailed`` and changes nothing.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with Storage(d, shard=0, num_shards=1) as st:
    ...     rows = st.table("user", RowFormat(dim=2, state_width=0))
    ...     batch = st.batch()
    ...     rows.put(batch, Rows(np.array([7]), np.ones((1, 2), np.float32), np.empty((1, 0), np.float32),
    ...                          np.array([3], np.uint32), np.array([1], np.uint32)))
    ...     st.commit(batch)
    ...     found, got = rows.get(np.array([7, 8]))
    >>> found.tolist(), got.keys.tolist(), got.values.tolist()
    ([True, False], [7], [[1.0, 1.0]])
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from pathlib import Path
from types import TracebackType
from typing import IO, cast

import grpc
import numpy as np
import numpy.typing as npt
import rocksdict

from ps import yielding
from ps.errors import ShardError
from ps.store.datadir import FORMAT_VERSION, DataDirError, has_room, lock_data_dir, open_failure, write_manifest
from ps.store.rows import RowFormat, Rows

__all__ = ["COMPRESSIONS", "DataDirError", "Storage", "StorageClosed", "StorageFailed", "TableRows", "table_options"]

log = logging.getLogger(__name__)

_META = "meta"
_TABLE_PREFIX = "t:"
_IDENTITY = b"identity"
_SPEC_PREFIX = b"spec:"
_LEDGER_PREFIX = b"ledger:"
_PROBE = b"write-probe"
_USER_PREFIX = b"note:"
_MAX_WAL_BYTES = 64 << 20  # write-ahead log kept (about): at most what a start after kill -9 replays
_SCAN_CHUNK = 1 << 16
_READ_THREADS = max(1, min(4, os.cpu_count() or 1))  # threads one multi-get is split across
_READ_PART_MIN = 512  # keys per thread, at least: below this a thread hand-off costs more


class StorageFailed(ShardError):
    """A write to RocksDB failed (disk full, I/O error): nothing of it was applied."""

    code = grpc.StatusCode.UNAVAILABLE


class StorageClosed(StorageFailed):
    """The storage was closed (the shard is shutting down): no fault of the disk."""


def _key_bytes(keys: npt.NDArray[np.int64]) -> list[bytes]:
    return np.ascontiguousarray(keys, dtype=">i8").view("V8").tolist()  # type: ignore[no-any-return]


def _keys_from(blobs: list[bytes]) -> npt.NDArray[np.int64]:
    return np.frombuffer(b"".join(blobs), dtype=">i8").astype(np.int64)


COMPRESSIONS = ("none", "lz4", "zstd")


def table_options(compression: str = "none") -> rocksdict.Options:
    """The RocksDB options of a table's column family (``compression``: none, lz4 or zstd)."""
    opts = rocksdict.Options(raw_mode=True)
    # Rows are looked up by key, never by range, and random float32 rows hardly compress;
    # 16-bit rows, constant rows and metadata words do a little (--disk-compression).
    opts.optimize_for_point_lookup(64)
    opts.set_compression_type(getattr(rocksdict.DBCompressionType, compression)())
    # Small memtables: an insert into (and a read of) a smaller skiplist touches fewer
    # cache lines, and rows spilled a while ago are read from SSTs with bloom filters.
    opts.set_write_buffer_size(16 << 20)
    return opts


class TableRows:
    """The rows of one table in RocksDB (one column family). Use through ``Storage.table``."""

    def __init__(self, storage: Storage, name: str, fmt: RowFormat) -> None:
        self.name = name
        self.format = fmt
        self.dim = fmt.dim
        self._storage = storage
        self._cf: rocksdict.Rdict | None = None
        self._handle: rocksdict.ColumnFamily | None = None
        self._bind()

    def _bind(self) -> None:
        """Take this table's column family from the storage's (re)opened database."""
        name = _TABLE_PREFIX + self.name
        self._cf = self._storage._column(name)
        self._handle = self._storage._db.get_column_family_handle(name)

    def get(self, keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.bool_], Rows]:
        """Which ``keys`` are stored, and the stored rows of those (in ``keys``' order). One multi-get."""
        n = keys.shape[0]
        if n == 0:
            return np.zeros(0, np.bool_), Rows.empty(self.format)
        cf = self._cf
        if cf is None:
            raise StorageFailed(f"storage in {self._storage.path} is not open (it failed and could not be reopened)")
        # rocksdict's stubs type a multi-get as taking and returning any key or value.
        get_many = cast("Callable[[list[bytes]], list[bytes | None]]", cf.get)
        blobs = self._storage._read(get_many, _key_bytes(keys))
        found = ~np.fromiter(map(operator.not_, blobs), dtype=np.bool_, count=n)
        return found, Rows.unpack(keys[found], b"".join(filter(None, blobs)), self.format)

    def put(self, batch: rocksdict.WriteBatch, rows: Rows) -> None:
        """Add ``rows`` to ``batch`` (written by ``Storage.commit``)."""
        if not len(rows):
            return
        # In RocksDB's key order (the big-endian bytes = the uint64 order), with the
        # write's memtable insert hint, inserts cost a third of random-order ones.
        order = np.argsort(np.ascontiguousarray(rows.keys, dtype=np.int64).view(np.uint64), kind="stable")
        ordered = rows[order]
        deque(
            map(
                batch.put,
                _key_bytes(ordered.keys),
                ordered.packed(self.format).view(f"V{self.format.record_bytes}").ravel().tolist(),
                repeat(self._handle),
            ),
            maxlen=0,
        )

    def delete(self, batch: rocksdict.WriteBatch, keys: npt.NDArray[np.int64]) -> None:
        deque(
            map(batch.delete, _key_bytes(np.sort(keys.view(np.uint64)).view(np.int64)), repeat(self._handle)), maxlen=0
        )

    def scan(self, chunk: int = _SCAN_CHUNK, start: int = 0, stop: int | None = None) -> Iterator[Rows]:
        """Every stored row, ``chunk`` rows at a time, in key-byte order (the keys' uint64
        order); with ``start``/``stop``, only keys whose uint64 value lies in ``[start, stop)``."""
        if self._cf is None:
            raise StorageFailed(f"storage in {self._storage.path} is not open (it failed and could not be reopened)")
        end = None if stop is None else stop.to_bytes(8, "big") if stop < 1 << 64 else None
        it = self._cf.iter()
        if start:
            it.seek(start.to_bytes(8, "big"))
        else:
            it.seek_to_first()
        while it.valid():
            ks: list[bytes] = []
            vs: list[bytes] = []
            while it.valid() and len(ks) < chunk:
                key = it.key()
                if end is not None and key >= end:
                    break
                ks.append(key)
                vs.append(it.value())
                it.next()
            if ks:
                yield Rows.unpack(_keys_from(ks), b"".join(vs), self.format)
            if len(ks) < chunk:
                return

    def estimate_rows(self) -> int:
        """RocksDB's estimate of the rows stored (exact only after a compaction)."""
        if self._cf is None:
            return 0
        value = self._cf.property_int_value("rocksdb.estimate-num-keys")
        return int(value or 0)

    def disk_bytes(self) -> int:
        """Bytes of the table's live RocksDB files (rows still in the memtable not counted)."""
        if self._cf is None:
            return 0
        return int(self._cf.property_int_value("rocksdb.live-sst-files-size") or 0)

    def put_ledger(self, batch: rocksdict.WriteBatch, name: str, data: bytes) -> None:
        """Add the ledger entry stored as ``name`` (``ps.table.ledger.TableLedgers``) to ``batch``;
        an empty ``data`` deletes it."""
        key = _LEDGER_PREFIX + self.name.encode() + b"\0" + name.encode()
        if data:
            batch.put(key, data, self._storage._meta_column_handle())
        else:
            batch.delete(key, self._storage._meta_column_handle())

    def ledgers(self) -> dict[str, bytes]:
        """Every client's stored ledger entry for this table."""
        prefix = _LEDGER_PREFIX + self.name.encode() + b"\0"
        return {k[len(prefix) :].decode(): v for k, v in self._storage._meta_items(prefix)}


class Storage:
    """An open data directory (see the module docstring). Close it (or use ``with``).

    Raises ``DataDirError`` when another process has it open, or when it belongs to
    another shard index or cluster size (both checked before anything is written).
    ``sync=True`` fsyncs the WAL on every commit (survives power loss, not only a
    killed process).
    """

    def __init__(
        self,
        path: Path,
        *,
        shard: int,
        num_shards: int,
        sync: bool = False,
        read_only: bool = False,
        compression: str = "none",
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r}: expected one of {', '.join(COMPRESSIONS)}")
        self.path = Path(path)
        self.read_only = read_only
        self._compression = compression
        self._lock_file: IO[str] | None = None
        if not read_only:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_file = lock_data_dir(self.path)
        elif not (self.path / "db").is_dir():
            raise DataDirError(f"{self.path}: no db/ directory here: not a data or checkpoint directory")
        self._write_opts = rocksdict.WriteOptions()
        self._write_opts.sync = sync
        self._write_opts.memtable_insert_hint_per_batch = True
        # Threads start at the first large read; none when there is one core.
        self._readers: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(_READ_THREADS - 1, thread_name_prefix="ps-read") if _READ_THREADS > 1 else None
        )
        try:
            self._db = self._open(read_only)
        except Exception as exc:
            self._unlock()
            raise DataDirError(open_failure(self.path, exc)) from None
        self._columns: dict[str, rocksdict.Rdict] = {}
        self._rows: list[TableRows] = []
        self._meta: rocksdict.Rdict | None = None
        self._meta_handle: rocksdict.ColumnFamily | None = None
        try:
            self._meta = self._column(_META)
            self._meta_handle = self._db.get_column_family_handle(_META)
            self._check_identity(shard, num_shards)
        except BaseException:
            self.close()  # release RocksDB and the lock: the caller may retry another way
            raise

    # -- opening -------------------------------------------------------------------------

    def _open(self, read_only: bool) -> rocksdict.Rdict:
        db_path = str(self.path / "db")
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_max_background_jobs(2)
        # A WAL file lives until every family with writes in it has flushed: the meta family
        # (a little ledger per push) would keep them all, and a start after kill -9 replays
        # them. Past this total RocksDB flushes the oldest file's families: bounded restarts.
        opts.set_max_total_wal_size(_MAX_WAL_BYTES)
        # Point reads of SST blocks through mmap skip a pread and a copy each.
        opts.set_allow_mmap_reads(True)
        existing = rocksdict.Rdict.list_cf(db_path) if (self.path / "db" / "CURRENT").exists() else []
        families = {name: table_options(self._compression) for name in existing if name.startswith(_TABLE_PREFIX)}
        families[_META] = rocksdict.Options(raw_mode=True)
        access = rocksdict.AccessType.read_only() if read_only else rocksdict.AccessType.read_write()
        return rocksdict.Rdict(db_path, opts, column_families=families, access_type=access)

    def _check_identity(self, shard: int, num_shards: int) -> None:
        raw = self._meta_column().get(_IDENTITY)
        if raw is None:
            if self.read_only:
                raise DataDirError(f"{self.path}: no shard identity stored: not a ps data directory")
            self._meta_column().put(
                _IDENTITY, json.dumps({"format": FORMAT_VERSION, "shard": shard, "num_shards": num_shards}).encode()
            )
            self.shard, self.num_shards = shard, num_shards
            return
        ident = json.loads(raw)
        self.shard, self.num_shards = int(ident["shard"]), int(ident["num_shards"])
        if ident.get("format") != FORMAT_VERSION:
            raise DataDirError(f"{self.path}: data format {ident.get('format')}, this ps-server reads {FORMAT_VERSION}")
        # A shard resharded live keeps being started with the flags it was first given.
        sizes = {int(n) for n in ident.get("num_shards_seen", ())} | {self.num_shards}
        if shard >= 0 and shard == self.shard and num_shards in sizes:
            return
        if shard >= 0 and (self.shard, self.num_shards) != (shard, num_shards):
            raise DataDirError(
                f"{self.path} holds shard {self.shard} of {self.num_shards}, but this process is shard "
                f"{shard} of {num_shards}: start it with --shard {self.shard} --num-shards {self.num_shards}, "
                "or reshard a checkpoint with `ps-admin reshard`"
            )

    def put_metas(self, items: dict[bytes, bytes], *, num_shards: int | None = None) -> None:
        """``put_meta`` of every item, in one atomic write (an empty value deletes its
        key). ``num_shards``: this shard now belongs to a cluster of that size (a
        reshard committed); a later start given any size it belonged to is still taken."""
        batch = self.batch()
        handle = self._meta_column_handle()
        for key, value in items.items():
            if value:
                batch.put(_USER_PREFIX + key, value, handle)
            else:
                batch.delete(_USER_PREFIX + key, handle)
        ident = None
        if num_shards is not None:
            ident = json.loads(self._meta_column().get(_IDENTITY) or b"{}")
            seen = {int(n) for n in ident.get("num_shards_seen", ())} | {int(ident["num_shards"]), num_shards}
            ident.update(num_shards=num_shards, num_shards_seen=sorted(seen))
            batch.put(_IDENTITY, json.dumps(ident).encode(), handle)
        self.commit(batch)
        if num_shards is not None:
            self.num_shards = num_shards

    def sizes_seen(self) -> set[int]:
        """Every cluster size this shard belonged to (the first, and each a reshard moved it to)."""
        raw = self._meta_column().get(_IDENTITY)
        if not isinstance(raw, bytes):
            return set()
        ident = json.loads(raw)
        return {int(n) for n in ident.get("num_shards_seen", ())} | {int(ident["num_shards"])}

    def identity(self) -> tuple[int, int]:
        """``(shard, num_shards)`` stored in this directory."""
        raw = self._meta_column().get(_IDENTITY)
        if not isinstance(raw, bytes):
            raise DataDirError(f"{self.path}: no shard identity stored: not a ps data directory")
        ident = json.loads(raw)
        return int(ident["shard"]), int(ident["num_shards"])

    def _column(self, name: str) -> rocksdict.Rdict:
        cf = self._columns.get(name) if hasattr(self, "_columns") else None
        if cf is None:
            if self._db is None:
                raise StorageFailed(f"storage in {self.path} is not open")
            try:
                cf = self._db.get_column_family(name)
            except Exception:
                if self.read_only:
                    raise DataDirError(f"{self.path}: no column family {name!r}") from None
                options = table_options(self._compression) if name != _META else rocksdict.Options(raw_mode=True)
                try:
                    cf = self._db.create_column_family(name, options)
                except Exception as exc:
                    raise StorageFailed(f"cannot create column family {name!r} in {self.path}: {exc}") from None
            self._columns[name] = cf
        return cf

    # -- tables and specs ----------------------------------------------------------------

    def table(self, name: str, fmt: RowFormat) -> TableRows:
        """The rows of table ``name``, stored as ``fmt`` (its column family is created if missing)."""
        rows = TableRows(self, name, fmt)
        self._rows.append(rows)
        return rows

    def save_spec(self, name: str, spec: bytes) -> None:
        """Remember a table's spec (the ``TableSpec`` protobuf) so a restart recreates it."""
        self._write(lambda: self._meta_column().put(_SPEC_PREFIX + name.encode(), spec, self._write_opts))

    def specs(self) -> dict[str, bytes]:
        """Every stored table spec by name."""
        return {k[len(_SPEC_PREFIX) :].decode(): v for k, v in self._meta_items(_SPEC_PREFIX)}

    def _meta_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        for k, v in self._meta_column().items(from_key=prefix):
            if not isinstance(k, bytes) or not k.startswith(prefix):
                break
            yield k, v

    def _meta_column(self) -> rocksdict.Rdict:
        if self._meta is None:
            raise StorageFailed(f"storage in {self.path} is not open (it failed and could not be reopened)")
        return self._meta

    def _meta_column_handle(self) -> rocksdict.ColumnFamily:
        if self._meta_handle is None:
            raise StorageFailed(f"storage in {self.path} is not open (it failed and could not be reopened)")
        return self._meta_handle

    # -- writing -------------------------------------------------------------------------

    def batch(self) -> rocksdict.WriteBatch:
        return rocksdict.WriteBatch(raw_mode=True)

    def commit(self, batch: rocksdict.WriteBatch) -> None:
        """Write ``batch`` atomically (WAL on); ``StorageFailed`` if RocksDB refuses it."""
        self._write(lambda: self._db.write(batch, self._write_opts))

    def _write(self, fn: object) -> None:
        if self._db is None:
            raise StorageClosed(f"storage in {self.path} is closed (the shard is shutting down)")
        try:
            fn()  # type: ignore[operator]
        except Exception as exc:
            raise StorageFailed(f"storage write failed in {self.path}: {exc}") from None

    def _read(self, get: Callable[[list[bytes]], list[bytes | None]], keys: list[bytes]) -> list[bytes | None]:
        """``get(keys)``, split across the reader threads when ``keys`` is long."""
        if self._db is None:
            raise StorageClosed(f"storage in {self.path} is closed (the shard is shutting down)")
        parts = min(_READ_THREADS, len(keys) // _READ_PART_MIN)
        try:
            # A thread of lowered priority (a reshard's copy) reads alone: the pool's threads,
            # shared with requests, would otherwise be started by it and inherit its priority.
            if parts <= 1 or self._readers is None or yielding.lowered():
                return get(keys)
            step = -(-len(keys) // parts)
            others = [self._readers.submit(get, keys[i : i + step]) for i in range(step, len(keys), step)]
            blobs = get(keys[:step])  # this thread reads the first part meanwhile
            for f in others:
                blobs += f.result()
            return blobs
        except Exception as exc:
            raise StorageFailed(f"storage read failed in {self.path}: {exc}") from None

    def checkpoint(self, path: Path, manifest: dict[str, object]) -> None:
        """Write a RocksDB checkpoint (hard links) to ``path/db`` and ``path/manifest.json``.

        The caller makes it consistent (flushes and holds its tables). ``path`` must not
        exist. Raises ``StorageFailed`` on an I/O error.
        """
        path = Path(path)
        try:
            path.mkdir(parents=True)
        except FileExistsError:
            raise StorageFailed(f"checkpoint path {path} exists: choose a new directory") from None
        except OSError as exc:
            raise StorageFailed(f"cannot create checkpoint directory {path}: {exc.strerror}") from None
        self._write(lambda: rocksdict.Checkpoint(self._db).create_checkpoint(str(path / "db")))
        write_manifest(path, manifest)

    def compact(self) -> None:
        """Compact every column family fully (blocks until done): after a bulk load."""
        for cf in self._columns.values():
            self._write(lambda cf=cf: cf.compact_range(None, None))

    def flush_memtables(self) -> None:
        """Write every column family's memtable to SST files (so a copy of the directory
        can hard-link them instead of copying a long WAL)."""
        for cf in self._columns.values():
            self._write(lambda cf=cf: cf.flush(True))

    def probe(self) -> None:
        """Write a small record (WAL on); ``StorageFailed`` unless RocksDB takes writes now."""
        stamp = np.array([time.time()], dtype="<f8").tobytes()
        self._write(lambda: self._meta_column().put(_PROBE, stamp, self._write_opts))

    def has_room(self) -> bool:
        """Whether RocksDB could be reopened in the data dir now (``ps.store.datadir.has_room``)."""
        return has_room(self.path)

    def put_meta(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` in the meta column family (WAL on)."""
        self._write(lambda: self._meta_column().put(_USER_PREFIX + key, value, self._write_opts))

    def metas(self, prefix: bytes) -> dict[bytes, bytes]:
        """Every ``put_meta`` item whose key starts with ``prefix``, by key."""
        full = _USER_PREFIX + prefix
        return {k[len(_USER_PREFIX) :]: bytes(v) for k, v in self._meta_items(full)}

    def get_meta(self, key: bytes) -> bytes | None:
        """What ``put_meta`` stored under ``key``, or None."""
        value = self._meta_column().get(_USER_PREFIX + key)
        return bytes(value) if value is not None else None

    def reopen(self) -> None:
        """Close RocksDB and open it again, in place: every ``TableRows`` keeps working.

        After a write fails (disk full, I/O error) RocksDB refuses every later write
        until it is reopened; opening replays its write-ahead log, so nothing written
        before is lost. The caller keeps every other user of this storage out
        meanwhile. If it cannot be opened for writing it is opened read-only (reads go
        on) and ``StorageFailed`` is raised; if not even that works, reads fail too
        until a later ``reopen`` succeeds.
        """
        self._drop_handles()
        if self._db is not None:
            with contextlib.suppress(Exception):  # a database that failed also fails to close cleanly
                self._db.close()
            self._db = None  # type: ignore[assignment]
        error: Exception | None = None
        try:
            self._db = self._open(self.read_only)
        except Exception as exc:
            error = exc
            if not self.read_only:
                with contextlib.suppress(Exception):
                    self._db = self._open(read_only=True)
        if self._db is not None:
            try:
                self._bind_handles()
            except Exception as exc:  # a column family the read-only view lacks
                error = error or exc
        if error is not None:
            raise StorageFailed(open_failure(self.path, error, reopening=True))
        log.info("reopened RocksDB in %s", self.path)

    def _drop_handles(self) -> None:
        # RocksDB stays open (and its LOCK held) while any column family object lives.
        for rows in self._rows:
            rows._cf = rows._handle = None
        self._columns.clear()
        self._meta = self._meta_handle = None

    def _bind_handles(self) -> None:
        self._meta = self._column(_META)
        self._meta_handle = self._db.get_column_family_handle(_META)
        for rows in self._rows:
            rows._bind()

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        readers = getattr(self, "_readers", None)
        if readers is not None:
            readers.shutdown(wait=True)  # no read may outlive the database
            self._readers = None
        if getattr(self, "_db", None) is not None:
            self._drop_handles()
            self._rows.clear()
            with contextlib.suppress(Exception):
                self._db.close()
            self._db = None  # type: ignore[assignment]
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
