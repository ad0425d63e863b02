"""Rescue dumps: acknowledged updates a stopping shard could not write to its data dir.

In ``interval:S`` and ``checkpoint-only`` modes a push is acknowledged before its rows
reach disk. If the data directory refuses writes (disk full, I/O error) when the
shard must stop, and keeps refusing them for the whole grace period, the shard writes
the rows it still holds unwritten, with every table's push ledger, to a *rescue dump*
in another directory, and exits non-zero naming it. Start the shard again on the same
data directory with ``ps-server --restore-from DUMP`` (once the disk has room): the
rows and ledgers are written into the data directory before the shard serves, the
data directory records that this dump was applied (a second ``--restore-from`` of it
is refused: its rows would overwrite newer ones), and the dump may then be deleted.

Layout (plain files, nothing of RocksDB, which may be what failed)::

    DUMP/manifest.json   written last, atomically: a dump without it is incomplete
    DUMP/<i>.keys        table i's keys, little-endian int64
    DUMP/<i>.rows        their rows in the data directory's row format (``ps.storage``)

``manifest.json``: ``{"format", "kind": "rescue", "id", "shard", "num_shards",
"data_dir", "created_unix_s", "created", "reason", "tables": [{"name", "spec",
"rows", "width", "crc32": {"keys", "rows"}, "ledgers": {client_id: hex}}]}``.
Every file is fsynced before the manifest is written.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> part = RescueTable(TableSpec("t", 2), np.array([7]), np.ones((1, 2), np.float32),
    ...                    np.empty((1, 0), np.float32), np.zeros(1, np.uint32), np.ones(1, np.uint32), {})
    >>> write_rescue(d / "dump", shard=0, num_shards=1, data_dir=d / "data", reason="disk full", tables=[part])
    1
    >>> is_rescue_dump(d / "dump"), is_rescue_dump(d)
    (True, False)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf import json_format

from protos import ps_pb2 as pb
from ps import optimizers
from ps.config import TableSpec, spec_from_proto, spec_to_proto
from ps.storage import FORMAT_VERSION, DataDirError, Storage, pack_records, read_manifest, write_manifest
from ps.table import Table, held_tables

__all__ = ["RescueTable", "StopReport", "apply_rescue", "is_rescue_dump", "save_rescue", "write_rescue"]

log = logging.getLogger(__name__)

KIND = "rescue"
_CHUNK_ROWS = 1 << 16


@dataclass
class RescueTable:
    """One table's part of a dump: rows not on disk (copies) and every ledger entry."""

    spec: TableSpec
    keys: npt.NDArray[np.int64]
    values: npt.NDArray[np.float32]
    state: npt.NDArray[np.float32]
    last_access: npt.NDArray[np.uint32]
    frequency: npt.NDArray[np.uint32]
    ledgers: dict[str, bytes]


def write_rescue(
    path: Path, *, shard: int, num_shards: int, data_dir: Path, reason: str, tables: list[RescueTable]
) -> int:
    """Write a dump of ``tables`` to the new directory ``path``; returns the rows written.

    Raises ``OSError`` (e.g. no space) after removing what it wrote; ``path`` must not exist.
    """
    path = Path(path)
    path.mkdir(parents=True)
    try:
        entries: list[dict[str, Any]] = []
        for i, t in enumerate(tables):
            records = pack_records(t.values, t.state, t.last_access, t.frequency)
            keys = np.ascontiguousarray(t.keys, dtype="<i8")
            entries.append(
                {
                    "name": t.spec.name,
                    "spec": json_format.MessageToDict(spec_to_proto(t.spec)),
                    "rows": int(keys.shape[0]),
                    "width": int(records.shape[1]),
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
    tables: list[Table], places: list[Path], *, shard: int, num_shards: int, data_dir: Path, error: str
) -> StopReport:
    """Write the rows of ``tables`` not on disk, and their ledgers, to the first of
    ``places`` that takes them (a stopping shard whose data dir failed with ``error``).
    Holds every table while copying; logs the outcome at ERROR."""
    with held_tables(tables) as held:
        parts = [
            RescueTable(h.table.spec, *h.unpersisted(), {c: h.table.ledger.encode(c) for c in h.table.ledger.clients()})
            for h in held
        ]
    rows = sum(p.keys.shape[0] for p in parts)
    failures = []
    for place in places:
        try:
            write_rescue(place, shard=shard, num_shards=num_shards, data_dir=data_dir, reason=error, tables=parts)
        except OSError as exc:
            failures.append(f"{place}: {exc.strerror or exc}")
            log.error("cannot write a rescue dump to %s: %s", place, exc.strerror or exc)
            continue
        log.error(
            "stopped with %d rows (changed by acknowledged pushes, or new) that data dir %s did not take (%s). They "
            "are saved in %s: once the disk is fixed, start this shard with --data-dir %s --restore-from %s",
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
        "%s (%s) nor to a rescue dump (%s): they are LOST; the data dir holds the state of its last durable point",
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
    intact, of this shard, with the same table specs, and not applied here before.
    Raises ``DataDirError`` saying what is wrong; ``StorageFailed`` if a write fails
    (then nothing is recorded as applied, and applying it again is safe).
    """
    dump = Path(dump)
    manifest: dict[str, Any] = read_manifest(dump)
    if manifest.get("kind") != KIND or manifest.get("format") != FORMAT_VERSION:
        raise DataDirError(f"{dump}: not a rescue dump of format {FORMAT_VERSION}")
    ident = (int(manifest["shard"]), int(manifest["num_shards"]))
    if ident != storage.identity():
        raise DataDirError(
            f"{dump} holds shard {ident[0]} of {ident[1]}, but {storage.path} is shard {storage.identity()[0]} "
            f"of {storage.identity()[1]}: apply it to the data dir it came from ({manifest.get('data_dir')})"
        )
    marker = f"rescue-applied:{manifest['id']}".encode()
    done = storage.get_meta(marker)
    if done is not None:
        raise DataDirError(
            f"rescue dump {dump} was already applied to {storage.path} ({done.decode()}): applying it again "
            "would overwrite newer rows; start the shard without --restore-from"
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
        width = spec.dim + optimizers.state_width(spec.optimizer, spec.dim) + 2
        keys = _read_checked(dump / f"{i}.keys", entry["crc32"]["keys"], np.dtype("<i8"), entry["rows"])
        records = _read_checked(dump / f"{i}.rows", entry["crc32"]["rows"], np.dtype("<f4"), entry["rows"] * width)
        if entry["width"] != width:
            raise DataDirError(f"{dump}: table {spec.name!r} rows are {entry['width']} words wide, expected {width}")
        plan.append(
            (spec, keys, records.reshape(-1, width), {c: bytes.fromhex(h) for c, h in entry["ledgers"].items()})
        )
    written: dict[str, int] = {}
    for spec, keys, records, ledgers in plan:
        rows = storage.table(spec.name, spec.dim, optimizers.state_width(spec.optimizer, spec.dim))
        for start in range(0, max(keys.shape[0], 1), _CHUNK_ROWS):
            batch = storage.batch()
            if start == 0:
                for client, data in ledgers.items():
                    rows.put_ledger(batch, client, data)
            chunk = rows.decode(records[start : start + _CHUNK_ROWS].tobytes(), min(_CHUNK_ROWS, keys.shape[0] - start))
            rows.put(
                batch, keys[start : start + _CHUNK_ROWS], chunk.values, chunk.state, chunk.last_access, chunk.frequency
            )
            storage.commit(batch)
        written[spec.name] = int(keys.shape[0])
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    storage.put_meta(marker, f"at {when} from {dump}".encode())
    log.info("applied rescue dump %s to %s: %s rows; the dump may now be deleted", dump, storage.path, written)
    return written


def _write_synced(path: Path, array: npt.NDArray[np.generic]) -> int:
    """Write ``array``'s bytes to the new file ``path`` and fsync it; returns their CRC-32."""
    data = np.ascontiguousarray(array).data.cast("B")
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
