"""Rescue dumps: acknowledged updates a stopping shard could not write to its data dir.

In ``interval:S`` and ``checkpoint-only`` modes a push is acknowledged before its rows
reach disk. If the data directory refuses writes (disk full, I/O error) when the
shard must stop, and keeps refusing them for the whole grace period, the shard writes
the rows it still holds unwritten, with every table's push ledger, to a *rescue dump*
in another directory, and exits non-zero naming it. Where: ``--rescue-dir`` first (give
it a directory on another volume than the data directory: a full disk refuses the dump
too), then the checkpoint root, then beside the data directory (``dump_places``).
Only a training shard writes dumps: a serving shard acknowledged no push, and what it
could not write comes again from its source (``Shard.shutdown``).

A dump must be applied before the data directory takes anything new, and never after:

* every ``ps-server`` start on a data directory looks for dumps of it in those places
  (``settle_dumps``) before it writes anything. A dump not applied yet is applied at
  once if the data directory is as the shard that wrote the dump left it; otherwise,
  or if the apply fails (the disk is still full), the shard refuses to start with a
  message naming the dump and the way on (free space and start again, or
  ``--discard-rescue DUMP``). It never starts past a dump silently;
* the data directory's *epoch* says which start wrote it last: a new one is stored
  (``begin_epoch``) by every start once its dumps are settled, and a dump records the
  epoch of the start that wrote it (its *base*) and the data directory's *lineage* (an
  id it shares with its checkpoints). A dump whose base is not the data directory's
  epoch is refused, by ``--restore-from`` too: another start wrote the data directory
  since, and the dump's rows may be older than the ones there;
* the data directory records that a dump was applied (a second ``--restore-from`` of it
  is refused: its rows would overwrite newer ones) or discarded; the dump may then be
  deleted.

Layout (plain files, nothing of RocksDB, which may be what failed)::

    DUMP/manifest.json   written last, atomically: a dump without it is incomplete
    DUMP/<i>.keys        table i's keys, little-endian int64
    DUMP/<i>.rows        their rows in the data directory's row format (``ps.store.storage``)

(An erase rewrites a table's files as ``<i>.g<n>.keys`` and ``.rows``, which the table's
``files`` in the manifest name: ``erase_from_dumps``.)

``manifest.json``: ``{"format", "kind": "rescue", "id", "shard", "num_shards",
"data_dir", "lineage", "base_epoch", "created_unix_s", "created", "reason", "tables":
[{"name", "spec", "rows", "record_bytes", "crc32": {"keys", "rows"}, "ledgers": {client_id:
hex}, "files", "generation"}]}`` (``files`` and ``generation`` only once an erase rewrote
the table's files; ``lineage`` and ``base_epoch`` are null for a data directory no
``ps-server`` start has given an epoch, e.g. one a test opened directly).
Every file is fsynced before the manifest is written.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> from ps.store import RowFormat, Rows
    >>> rows = Rows(np.array([7]), np.ones((1, 2), np.float32), np.empty((1, 0), np.float32),
    ...             np.zeros(1, np.uint32), np.ones(1, np.uint32))
    >>> part = RescueTable(TableSpec("t", 2), rows, {})
    >>> write_rescue(d / "dump", shard=0, num_shards=1, data_dir=d / "data", reason="disk full", tables=[part])
    1
    >>> is_rescue_dump(d / "dump"), is_rescue_dump(d)
    (True, False)
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf import json_format

from protos import ps_pb2 as pb
from ps.store import (
    FORMAT_VERSION,
    DataDirError,
    Rows,
    Storage,
    StorageFailed,
    read_manifest,
    write_manifest,
)
from ps.table import Table, TableSpec, held_tables, spec_from_proto, spec_to_proto

__all__ = [
    "RescueBase",
    "RescueTable",
    "StopReport",
    "apply_rescue",
    "begin_epoch",
    "discard_rescue",
    "dump_places",
    "is_rescue_dump",
    "read_base",
    "rows_at_risk",
    "save_rescue",
    "set_lineage",
    "settle_dumps",
    "write_rescue",
]

log = logging.getLogger(__name__)

KIND = "rescue"
_CHUNK_ROWS = 1 << 16
_LINEAGE = b"lineage"  # data dir notes (``Storage.put_meta``)
_EPOCH = b"epoch"
_APPLIED = b"rescue-applied:"  # + dump id: when, and from where
_DISCARDED = b"rescue-discarded:"


@dataclass(frozen=True)
class RescueBase:
    """What a dump is based on: the data directory's ``lineage`` (an id made once, shared
    by its checkpoints and copies) and the ``epoch`` of the shard start that wrote it
    last (see the module docstring). None: never set (no ``begin_epoch`` yet)."""

    lineage: str | None = None
    epoch: str | None = None


def read_base(storage: Storage) -> RescueBase:
    """The lineage and epoch stored in ``storage`` (a read)."""
    lineage, epoch = storage.get_meta(_LINEAGE), storage.get_meta(_EPOCH)
    return RescueBase(lineage.decode() if lineage else None, epoch.decode() if epoch else None)


def set_lineage(storage: Storage, lineage: str) -> None:
    """Store ``lineage`` as the one of the data dir ``storage`` (a new data dir holding a
    copy of another's rows, e.g. a checkpoint of a shard without a data dir). Raises
    ``StorageFailed``."""
    storage.put_meta(_LINEAGE, lineage.encode())


def begin_epoch(storage: Storage) -> RescueBase:
    """Store a new epoch in ``storage`` (and a lineage, if it has none): a shard start
    does this once its dumps are settled, before it writes anything else. Raises
    ``StorageFailed`` (e.g. the disk is full)."""
    lineage = read_base(storage).lineage
    if lineage is None:
        lineage = uuid.uuid4().hex
        storage.put_meta(_LINEAGE, lineage.encode())
    epoch = uuid.uuid4().hex
    storage.put_meta(_EPOCH, epoch.encode())
    return RescueBase(lineage, epoch)


def dump_places(data_dir: Path, rescue_dir: Path | None, checkpoint_root: Path | None) -> list[tuple[Path, str]]:
    """Where the dumps of ``data_dir`` go, in the order tried, as ``(directory, name
    prefix)``: ``rescue_dir`` (``--rescue-dir``), ``checkpoint_root``, and beside the
    data dir (``<data_dir>.rescue-...``). ``settle_dumps`` looks in the same places."""
    data_dir = Path(data_dir).absolute()
    places = [(Path(d).absolute(), "rescue-") for d in (rescue_dir, checkpoint_root) if d is not None]
    places.append((data_dir.parent, f"{data_dir.name}.rescue-"))
    return list(dict.fromkeys(places))


@dataclass
class RescueTable:
    """One table's part of a dump: rows not on disk (copies) and every ledger entry."""

    spec: TableSpec
    rows: Rows
    ledgers: dict[str, bytes]


def rows_at_risk(tables: list[Table], every_push: bool) -> int | None:
    """Rows changed by acknowledged pushes that are only in RAM (None: none, and no ledger
    entry either): what a stop whose disk refuses the final write must save. In
    every-push mode each push was written before it was acknowledged."""
    unwritten = sum(t.unpersisted_rows() for t in tables)
    if every_push or not (unwritten or any(t.ledgers.has_changes() for t in tables)):
        return None
    return unwritten


def write_rescue(
    path: Path,
    *,
    shard: int,
    num_shards: int,
    data_dir: Path,
    reason: str,
    tables: list[RescueTable],
    base: RescueBase = RescueBase(),
) -> int:
    """Write a dump of ``tables`` to the new directory ``path``; returns the rows written.

    Raises ``OSError`` (e.g. no space) after removing what it wrote; ``path`` must not exist.
    """
    path = Path(path)
    path.mkdir(parents=True)
    try:
        entries: list[dict[str, Any]] = []
        for i, t in enumerate(tables):
            records = t.rows.packed(t.spec.row_format)
            keys = np.ascontiguousarray(t.rows.keys, dtype="<i8")
            entries.append(
                {
                    "name": t.spec.name,
                    "spec": json_format.MessageToDict(spec_to_proto(t.spec)),
                    "rows": int(keys.shape[0]),
                    "record_bytes": int(records.dtype.itemsize),
                    "crc32": {
                        "keys": _write_synced(path / f"{i}.keys", keys),
                        "rows": _write_synced(path / f"{i}.rows", records),
                    },
                    "ledgers": {client: data.hex() for client, data in sorted(t.ledgers.items())},
                }
            )
        write_manifest(
            path,
            {
                "format": FORMAT_VERSION,
                "kind": KIND,
                "id": uuid.uuid4().hex,
                "shard": shard,
                "num_shards": num_shards,
                "data_dir": str(Path(data_dir).absolute()),
                "lineage": base.lineage,
                "base_epoch": base.epoch,
                "created_unix_s": time.time(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "reason": reason,
                "tables": entries,
            },
        )
        _fsync_dir(path)
    except BaseException:
        _remove(path)
        raise
    return sum(e["rows"] for e in entries)


@dataclass(frozen=True)
class StopReport:
    """How a shard stopped. ``clean``: every acknowledged update is in the data dir.
    Otherwise ``unpersisted_rows`` rows were saved in ``rescue_path`` or, if it is
    None, lost (``rescue_failures`` says why each place failed). ``error``: the last
    storage error, if any (a clean stop may have one: see ``Shard.shutdown``)."""

    error: str = ""
    unpersisted_rows: int = 0
    rescue_path: Path | None = None
    rescue_failures: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.unpersisted_rows == 0

    @property
    def lost(self) -> bool:
        return self.unpersisted_rows > 0 and self.rescue_path is None


def save_rescue(
    tables: list[Table],
    places: list[tuple[Path, str]],
    shard: tuple[int, int],
    data_dir: Path,
    error: str,
    base: RescueBase = RescueBase(),
) -> StopReport:
    """Write the rows of ``tables`` not on disk, and their ledgers, to a new dump in the
    first of ``places`` (``(directory, name prefix)``, see ``dump_places``) that takes
    them: what shard ``(index, num_shards)`` could not write to ``data_dir``, which
    failed with ``error``; ``base``: what the data dir holds (``RescueBase``). Holds
    every table while copying; logs the outcome at ERROR."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
    with held_tables(tables) as held:
        parts = [RescueTable(h.spec, h.unpersisted(), dict(h.ledgers.entries())) for h in held]
    rows = sum(len(p.rows) for p in parts)
    failures = []
    for directory, prefix in places:
        place = directory / f"{prefix}{stamp}"
        try:
            write_rescue(
                place, shard=shard[0], num_shards=shard[1], data_dir=data_dir, reason=error, tables=parts, base=base
            )
        except OSError as exc:
            failures.append(f"{place}: {exc.strerror or exc}")
            log.error("cannot write a rescue dump to %s: %s", place, exc.strerror or exc)
            continue
        log.error(
            "stopped with %d rows (changed by acknowledged pushes, or new) that data dir %s did not take (%s). They "
            "are saved in %s: once the disk is fixed, start this shard again on --data-dir %s and it applies "
            "the dump before it serves; if the dump is moved elsewhere, add --restore-from %s",
            rows,
            data_dir,
            error,
            place,
            data_dir,
            place,
        )
        return StopReport(error=error, unpersisted_rows=rows, rescue_path=place)
    log.error(
        "stopped with %d rows (changed by acknowledged pushes, or new) that could be written neither to data dir "
        "%s (%s) nor to a rescue dump (%s): they are LOST; the data dir holds the state of its last durable point. "
        "Give --rescue-dir a directory on another volume than the data dir, so that a full disk cannot refuse both",
        rows,
        data_dir,
        error,
        "; ".join(failures),
    )
    return StopReport(error=error, unpersisted_rows=rows, rescue_failures=failures)


def is_rescue_dump(path: Path) -> bool:
    """Whether ``path`` holds a (complete) rescue dump rather than a checkpoint."""
    try:
        return read_manifest(path).get("kind") == KIND
    except DataDirError:
        return False


def apply_rescue(dump: Path, storage: Storage) -> dict[str, int]:
    """Write the rows and ledgers of ``dump`` into ``storage`` (before a shard opens it);
    returns rows written per table.

    Everything is checked before anything is written: the dump must be complete and
    intact, of this shard and data dir, with the same table specs, neither applied nor
    discarded here before, and based on what the data dir holds (its epoch: no start
    wrote it since the dump). Raises ``DataDirError`` saying what is wrong;
    ``StorageFailed`` if a write fails (then nothing is recorded as applied, and
    applying it again is safe).
    """
    dump = Path(dump)
    manifest = _read_dump(dump)
    _check_identity(dump, manifest, storage)
    base = read_base(storage)
    lineage = manifest.get("lineage")
    if lineage is not None and lineage != base.lineage:
        raise DataDirError(
            f"{dump} is a rescue dump of another data dir than {storage.path} (it came from "
            f"{manifest.get('data_dir')}): apply it to that one, or a copy of it"
        )
    done = _settled(manifest, storage)
    if done is not None:
        raise DataDirError(
            f"rescue dump {dump} was already {done} {storage.path}: applying it now "
            "would overwrite newer rows; start the shard without --restore-from"
        )
    if manifest.get("base_epoch") != base.epoch:
        raise DataDirError(
            f"rescue dump {dump} was written on top of another state of {storage.path} than the one there now: a "
            "shard started on the data dir since (or it was restored from a checkpoint), so the dump's rows may be "
            f"older than the data dir's and would overwrite newer ones. Start without it: --discard-rescue={dump}"
        )
    stored = {name: spec_from_proto(pb.TableSpec.FromString(blob)) for name, blob in storage.specs().items()}
    plan = []
    for i, entry in enumerate(manifest["tables"]):
        spec = spec_from_proto(json_format.ParseDict(entry["spec"], pb.TableSpec()))
        if spec.name not in stored:
            # A table's spec is stored before it takes its first row, so the data dir the
            # dump came from (or a copy of it) has every table: this one is another dir.
            raise DataDirError(
                f"{dump}: {storage.path} has no table {spec.name!r}: a rescue dump holds only the rows its shard "
                f"could not write, so apply it to the data dir it came from ({manifest.get('data_dir')}) or a "
                "copy of it, never to a new one"
            )
        if stored[spec.name] != spec:
            raise DataDirError(
                f"{dump}: table {spec.name!r} differs from the one in {storage.path}: "
                f"{'; '.join(stored[spec.name].differences(spec))} (data dir != dump)"
            )
        fmt = spec.row_format
        record_bytes = entry.get("record_bytes", 4 * entry.get("width", 0))  # dumps before 16-bit rows: words
        if record_bytes != fmt.record_bytes:
            raise DataDirError(
                f"{dump}: table {spec.name!r} rows are {record_bytes} bytes each, expected {fmt.record_bytes}"
            )
        keys = _read_checked(dump / _file(entry, i, "keys"), entry["crc32"]["keys"], np.dtype("<i8"), entry["rows"])
        records = _read_checked(dump / _file(entry, i, "rows"), entry["crc32"]["rows"], fmt.record, entry["rows"])
        plan.append((spec, keys, records, {c: bytes.fromhex(h) for c, h in entry["ledgers"].items()}))
    written: dict[str, int] = {}
    for spec, keys, records, ledgers in plan:
        fmt = spec.row_format
        rows = storage.table(spec.name, fmt)
        for start in range(0, max(keys.shape[0], 1), _CHUNK_ROWS):
            batch = storage.batch()
            if start == 0:
                for client, data in ledgers.items():
                    rows.put_ledger(batch, client, data)
            end = start + _CHUNK_ROWS
            rows.put(batch, Rows.unpack(keys[start:end], records[start:end], fmt))
            storage.commit(batch)
        written[spec.name] = int(keys.shape[0])
    storage.put_meta(_APPLIED + manifest["id"].encode(), f"at {_now()} from {dump}".encode())
    log.info("applied rescue dump %s to %s: %s rows; the dump may now be deleted", dump, storage.path, written)
    return written


def discard_rescue(dump: Path, storage: Storage) -> None:
    """Record in ``storage`` that ``dump`` (a dump of it) is never to be applied: its rows
    are given up, and a start no longer refuses because of it. The dump stays on disk.
    A dump applied or discarded before, or no longer there, is left as it is (logged:
    a setting left in place must not stop later starts). Raises ``DataDirError`` for a
    directory that is not a dump of this data dir, ``StorageFailed`` if the note cannot
    be written."""
    dump = Path(dump)
    if not dump.exists():
        log.warning("--discard-rescue %s: no such dump (deleted?); nothing to do", dump)
        return
    manifest = _read_dump(dump)
    _check_identity(dump, manifest, storage)
    if not _is_of(manifest, storage, read_base(storage)):
        raise DataDirError(f"--discard-rescue {dump}: not a rescue dump of data dir {storage.path}")
    done = _settled(manifest, storage)
    if done is not None:
        log.warning("--discard-rescue %s: the dump was already %s %s; nothing to do", dump, done, storage.path)
        return
    storage.put_meta(_DISCARDED + manifest["id"].encode(), f"at {_now()} from {dump}".encode())
    log.warning(
        "discarded rescue dump %s: its %d rows of acknowledged updates will not be applied to %s (the dump stays on "
        "disk; delete it once you no longer need it)",
        dump,
        _rows(manifest),
        storage.path,
    )


def settle_dumps(
    storage: Storage,
    places: list[tuple[Path, str]],
    *,
    discard: Path | None = None,
    restored_checkpoint: Path | None = None,
) -> list[Path]:
    """Deal with every dump of ``storage``'s data dir in ``places`` (see ``dump_places``)
    that is neither applied nor discarded, before a shard starts on it; returns the
    dumps applied.

    ``discard`` is discarded first. A dump based on the data dir's current epoch is
    applied (it holds the newest rows); any other dump not settled yet raises
    ``DataDirError`` with a one-line message naming it and the way on: one of unknown
    base (an older ps-server wrote it) may be applied with ``--restore-from`` or
    discarded; one whose base is gone (a start wrote the data dir since) or that would
    land on ``restored_checkpoint`` (a checkpoint this start restored) may only be
    discarded. Also raises ``DataDirError`` when applying fails (e.g. the disk is still
    full): nothing is recorded then, and the next start tries again.
    """
    if discard is not None:
        discard_rescue(discard, storage)
    base = read_base(storage)
    applied: list[Path] = []
    for dump, manifest in _find_dumps(places):
        if not _is_of(manifest, storage, base) or _settled(manifest, storage) is not None:
            continue
        what = (
            f"data dir {storage.path} has a rescue dump that was never applied: {dump} ({_rows(manifest)} rows of "
            f"acknowledged updates its shard could not write at {manifest.get('created')}: {manifest.get('reason')})"
        )
        if restored_checkpoint is not None:
            raise DataDirError(
                f"{what}; this start restores checkpoint {restored_checkpoint}, and the dump's rows would be mixed "
                f"into it. To restore the checkpoint without them, add --discard-rescue={dump}"
            )
        if manifest.get("lineage") is None:
            raise DataDirError(
                f"{what}; it does not record which state of the data dir it was written on. If no shard has run on "
                f"the data dir since, apply it: --restore-from={dump}; otherwise start without it: "
                f"--discard-rescue={dump}"
            )
        if manifest.get("base_epoch") != base.epoch:
            raise DataDirError(
                f"{what}; a shard started on the data dir since (or it was restored from a checkpoint), so the "
                f"dump's rows may be older than the data dir's and cannot be applied. Start without them: "
                f"--discard-rescue={dump}"
            )
        log.warning("%s; applying it now (the data dir is as the shard that wrote the dump left it)", what)
        try:
            apply_rescue(dump, storage)
        except StorageFailed as exc:
            raise DataDirError(
                f"cannot apply rescue dump {dump} to data dir {storage.path}: {exc}. Free space (or fix the disk) "
                f"and start again: the dump is applied then; or start without its rows: --discard-rescue={dump}"
            ) from None
        applied.append(dump)
    return applied


def dumps_of(storage: Storage, places: list[tuple[Path, str]]) -> list[Path]:
    """Every (complete) dump of ``storage``'s data dir in ``places``."""
    base = read_base(storage)
    return [dump for dump, manifest in _find_dumps(places) if _is_of(manifest, storage, base)]


def erase_from_dumps(
    storage: Storage,
    places: list[tuple[Path, str]],
    table: str,
    keys: npt.NDArray[np.int64],
    only: Collection[str] | None = None,
) -> list[tuple[Path, int]]:
    """Delete the rows of ``keys`` of ``table`` from every dump of ``storage``'s data dir in
    ``places`` (of ``only``, when given: paths); ``(dump, rows deleted)`` for each dump that
    holds the table.

    A dump's files are never changed in place: the rows kept go to new files, then the
    manifest names them (an atomic rename), then the old files are removed. A stop at any
    point leaves a dump whose manifest and files agree (files it no longer names are
    removed by the next erase)."""
    base = read_base(storage)
    out = []
    for dump, manifest in _find_dumps(places):
        if not _is_of(manifest, storage, base) or (only is not None and str(dump) not in only):
            continue
        entries = manifest["tables"]
        named = {"manifest.json"}
        erased, held = 0, False
        try:
            for i, entry in enumerate(entries):
                if entry["name"] == table:
                    held = True
                    erased += _erase_entry(dump, i, entry, keys)
                named |= {_file(entry, i, "keys"), _file(entry, i, "rows")}
        except DataDirError as exc:  # damaged: left as it is (find_in_dumps still reads its keys)
            log.warning("cannot erase rows from rescue dump %s: %s", dump, exc)
            out.append((dump, 0))
            continue
        except OSError as exc:
            raise StorageFailed(f"cannot rewrite rescue dump {dump}: {exc.strerror or exc}") from None
        if not held:
            continue
        try:
            if erased:
                write_manifest(dump, manifest)
                _fsync_dir(dump)
            for stale in dump.iterdir():  # the files before this erase (or one a stop cut short)
                if _TABLE_FILE.fullmatch(stale.name) and stale.name not in named:
                    stale.unlink()
        except OSError as exc:
            raise StorageFailed(f"cannot rewrite rescue dump {dump}: {exc.strerror or exc}") from None
        out.append((dump, erased))
    return out


def find_in_dumps(
    storage: Storage, places: list[tuple[Path, str]], table: str, keys: npt.NDArray[np.int64]
) -> list[tuple[Path, int]]:
    """``(dump, rows of keys it holds)`` for every dump of ``storage``'s data dir in
    ``places`` that holds ``table``; also counts the rows of files its manifest no longer names."""
    base = read_base(storage)
    out = []
    for dump, manifest in _find_dumps(places):
        if not _is_of(manifest, storage, base):
            continue
        found, held = 0, False
        for i, entry in enumerate(manifest["tables"]):
            if entry["name"] != table:
                continue
            held = True
            for path in {dump / _file(entry, i, "keys"), *dump.glob(f"{i}.*keys")}:
                try:
                    stored = np.fromfile(path, dtype="<i8")
                except FileNotFoundError:  # removed by an erase meanwhile
                    continue
                except OSError as exc:
                    raise StorageFailed(f"cannot read rescue dump file {path}: {exc.strerror or exc}") from None
                found += int(np.isin(stored, keys).sum())
        if held:
            out.append((dump, found))
    return out


def _erase_entry(dump: Path, i: int, entry: dict[str, Any], keys: npt.NDArray[np.int64]) -> int:
    """Write table entry ``i`` of ``dump`` without the rows of ``keys`` to new files and
    point ``entry`` at them; returns the rows left out (0: nothing written)."""
    record_bytes = int(entry.get("record_bytes", 4 * entry.get("width", 0)))
    record = np.dtype((np.void, record_bytes))
    held = _read_checked(dump / _file(entry, i, "keys"), entry["crc32"]["keys"], np.dtype("<i8"), entry["rows"])
    records = _read_checked(dump / _file(entry, i, "rows"), entry["crc32"]["rows"], record, entry["rows"])
    keep = ~np.isin(held, keys)
    erased = int(keep.shape[0] - keep.sum())
    if not erased:
        return 0
    generation = int(entry.get("generation", 0)) + 1
    files = {"keys": f"{i}.g{generation}.keys", "rows": f"{i}.g{generation}.rows"}
    for name in files.values():
        (dump / name).unlink(missing_ok=True)  # of a stop cut short
    entry["crc32"] = {
        "keys": _write_synced(dump / files["keys"], held[keep]),
        "rows": _write_synced(dump / files["rows"], records[keep]),
    }
    entry.update(rows=int(keep.sum()), files=files, generation=generation)
    return erased


_TABLE_FILE = re.compile(r"\d+\.(g\d+\.)?(keys|rows)")


def _file(entry: dict[str, Any], i: int, kind: str) -> str:
    """The file of table entry ``i``'s ``kind`` ("keys" or "rows") in its dump."""
    return str(entry.get("files", {}).get(kind, f"{i}.{kind}"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _read_dump(dump: Path) -> dict[str, Any]:
    if not (dump / "manifest.json").is_file():
        raise DataDirError(f"{dump}: no manifest.json: not a rescue dump (or one whose writing did not finish)")
    manifest: dict[str, Any] = read_manifest(dump)
    if manifest.get("kind") != KIND or manifest.get("format") != FORMAT_VERSION:
        raise DataDirError(f"{dump}: not a rescue dump of format {FORMAT_VERSION}")
    return manifest


def _check_identity(dump: Path, manifest: dict[str, Any], storage: Storage) -> None:
    ident = (int(manifest["shard"]), int(manifest["num_shards"]))
    if ident != storage.identity():
        raise DataDirError(
            f"{dump} holds shard {ident[0]} of {ident[1]}, but {storage.path} is shard {storage.identity()[0]} "
            f"of {storage.identity()[1]}: apply it to the data dir it came from ({manifest.get('data_dir')})"
        )


def _is_of(manifest: dict[str, Any], storage: Storage, base: RescueBase) -> bool:
    """Whether a dump came from this data dir: the same lineage, or (a dump that records
    none) the same shard and path."""
    if (int(manifest["shard"]), int(manifest["num_shards"])) != storage.identity():
        return False
    lineage = manifest.get("lineage")
    if lineage is not None:
        return bool(lineage == base.lineage)
    return bool(manifest.get("data_dir") == str(storage.path.absolute()))


def _settled(manifest: dict[str, Any], storage: Storage) -> str | None:
    """ "applied to" or "discarded in" if the data dir records so for this dump, else None."""
    ident = manifest["id"].encode()
    if storage.get_meta(_APPLIED + ident) is not None:
        return "applied to"
    if storage.get_meta(_DISCARDED + ident) is not None:
        return "discarded in"
    return None


def _rows(manifest: dict[str, Any]) -> int:
    return sum(int(t["rows"]) for t in manifest.get("tables", []))


def _find_dumps(places: list[tuple[Path, str]]) -> list[tuple[Path, dict[str, Any]]]:
    """Every complete dump in ``places``, oldest first; incomplete ones are logged."""
    found = []
    for directory, prefix in places:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob(glob.escape(prefix) + "*")):
            if not path.is_dir():
                continue
            try:
                found.append((path, _read_dump(path)))
            except DataDirError as exc:
                log.warning("ignoring %s: not a complete rescue dump (%s)", path, exc)
    return sorted(found, key=lambda f: float(f[1].get("created_unix_s", 0.0)))


def _write_synced(path: Path, array: npt.NDArray[np.generic]) -> int:
    """Write ``array``'s bytes to the new file ``path`` and fsync it; returns their CRC-32."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
    with path.open("xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return zlib.crc32(data)


def _read_checked(path: Path, crc: int, dtype: np.dtype[Any], count: int) -> npt.NDArray[Any]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataDirError(f"rescue dump file {path}: {exc.strerror}") from None
    if len(data) != count * dtype.itemsize or zlib.crc32(data) != crc:
        raise DataDirError(f"rescue dump file {path} is damaged (size or checksum differs from manifest.json)")
    return np.frombuffer(data, dtype=dtype)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
