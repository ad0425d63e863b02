"""Erased rows out of a shard's checkpoints: each checkpoint part under its checkpoint root
is opened, the keys' rows deleted, and its RocksDB compacted, so that no checkpoint brings an
erased key back (a restore, ``serve-from``, a reshard or a load reads the part as it is now)
and the bytes leave the disk (a checkpoint's files are hard links of the data dir's: once
both are compacted, no link to the old file remains).

``find_in_checkpoints`` counts the keys' rows each part holds, without changing anything
(what ``ps-admin erase --verify`` asks).

An erase takes several steps (RAM and data dir, checkpoints, rescue dumps, compaction); a
shard killed between them must not leave it half done and silent. So the shard first
writes the erase to its data dir's *erase journal* (``journal_erase``: the table, the keys
and what was asked), and removes it only once every step is done (``close_erase``). A
start finds what is still there (``pending_erasures``) and completes it before it serves.

Example:
    >>> parts_under(None)
    []
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from ps.store import DataDirBusy, DataDirError, Storage, StorageFailed, TableRows
from ps.table import spec_from_proto

__all__ = [
    "PendingErase",
    "close_erase",
    "erase_data_done",
    "erase_from_checkpoints",
    "find_in_checkpoints",
    "journal_erase",
    "parts_under",
    "pending_erasures",
]

log = logging.getLogger(__name__)

_JOURNAL = b"erase-journal:"
PART_BUSY_S = 120.0  # how long to wait for a checkpoint part another shard is rewriting


@dataclass(frozen=True)
class PendingErase:
    """An erase written to the journal and not (known to be) finished. ``places``: the
    checkpoint parts and rescue dumps there were when it began (those made since hold no row
    it erased: one there is was made again since, and stays); ``data_done``: the rows are
    gone from RAM and the data dir (a start must not erase the keys there again: rows made
    for them since are new). ``keys`` are erased everywhere; ``others`` (keys other shards
    own) from the checkpoints and dumps only."""

    id: str
    table: str
    keys: npt.NDArray[np.int64]
    compact: bool
    checkpoints: bool
    started_unix_s: float
    places: tuple[str, ...] | None = None  # None: every one there is
    data_done: bool = False
    others: npt.NDArray[np.int64] = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def everywhere(self) -> npt.NDArray[np.int64]:
        """Every key whose rows leave the checkpoints and dumps: ``keys`` and ``others``."""
        return np.union1d(self.keys, self.others)


def journal_erase(
    storage: Storage,
    table: str,
    keys: npt.NDArray[np.int64],
    *,
    compact: bool,
    checkpoints: bool,
    places: Sequence[Path] | None = None,
    others: npt.NDArray[np.int64] | None = None,
) -> PendingErase:
    """Write an erase to ``storage``'s journal before any of it is done; the entry to close.
    ``places``: the checkpoint parts and dumps it is to rewrite (None: every one there is then);
    ``others``: keys to erase from those only."""
    listed = tuple(map(str, places)) if places is not None else None
    rest = others if others is not None else np.zeros(0, np.int64)
    job = PendingErase(uuid.uuid4().hex, table, keys, compact, checkpoints, time.time(), listed, others=rest)
    _put(storage, job)
    return job


def erase_data_done(storage: Storage, job: PendingErase) -> PendingErase:
    """Note in the journal that ``job``'s rows are gone from RAM and the data dir."""
    done = dataclasses.replace(job, data_done=True)
    _put(storage, done)
    return done


def _put(storage: Storage, job: PendingErase) -> None:
    head = {
        "table": job.table,
        "compact": job.compact,
        "checkpoints": job.checkpoints,
        "started_unix_s": job.started_unix_s,
        "places": list(job.places) if job.places is not None else None,
        "data_done": job.data_done,
        "others": int(job.others.shape[0]),  # the last keys of the entry
    }
    keys = np.concatenate([job.keys, job.others]).astype("<i8")
    storage.put_meta(_JOURNAL + job.id.encode(), json.dumps(head).encode() + b"\n" + keys.tobytes())


def pending_erasures(storage: Storage) -> list[PendingErase]:
    """The erases in ``storage``'s journal, oldest first. Raises ``StorageFailed`` for an
    entry that cannot be read."""
    jobs = []
    for key, value in storage.metas(_JOURNAL).items():
        head_bytes, _, key_bytes = value.partition(b"\n")
        try:
            head = json.loads(head_bytes)
            keys = np.frombuffer(key_bytes, dtype="<i8").astype(np.int64)
            n_others = int(head.get("others", 0))
            if not 0 <= n_others <= keys.shape[0]:
                raise ValueError(f"others={n_others} of {keys.shape[0]} keys")
            keys, others = keys[: keys.shape[0] - n_others], keys[keys.shape[0] - n_others :]
            job = PendingErase(
                key[len(_JOURNAL) :].decode(),
                str(head["table"]),
                keys,
                bool(head["compact"]),
                bool(head["checkpoints"]),
                float(head["started_unix_s"]),
                tuple(str(p) for p in head["places"]) if head.get("places") is not None else None,
                bool(head.get("data_done", False)),
                others,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise StorageFailed(f"erase journal entry {key!r} in {storage.path} is damaged: {exc}") from None
        jobs.append(job)
    return sorted(jobs, key=lambda j: j.started_unix_s)


def close_erase(storage: Storage, job: PendingErase) -> None:
    """Remove ``job`` from the journal: every step of it is done."""
    storage.put_metas({_JOURNAL + job.id.encode(): b""})


def parts_under(root: Path | None) -> list[Path]:
    """Every checkpoint part under ``root``: ``NAME/shard-IIIII-of-NNNNN``, or ``NAME`` itself
    (a part of one shard, the older layout), in name order."""
    if root is None or not root.is_dir():
        return []
    parts: list[Path] = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            parts += [entry] if (entry / "db").is_dir() else sorted(p for p in entry.glob("shard-*-of-*") if p.is_dir())
    return parts


def _rows(path: Path, table: str) -> Iterator[tuple[Storage, TableRows]]:
    """The rows of ``table`` in the checkpoint part ``path``, opened read-only (nothing if it
    does not hold the table; a part that cannot be opened is logged and skipped)."""
    try:
        st = Storage(path, shard=-1, num_shards=0, read_only=True)
    except DataDirError as exc:
        log.warning("checkpoint part %s cannot be opened, skipped: %s", path, exc)
        return
    with st:
        blob = st.specs().get(table)
        if blob is not None:
            yield st, st.table(table, spec_from_proto(pb.TableSpec.FromString(blob)).row_format)


def find_in_checkpoints(
    root: Path | None, table: str, keys: npt.NDArray[np.int64], *, part: bool = False
) -> list[tuple[Path, int]]:
    """``(part, rows of keys it holds)`` for every checkpoint part under ``root`` (or of
    ``root`` itself, with ``part``) that holds ``table``."""
    out = []
    for path in [root] if part and root is not None else parts_under(root):
        for _, rows in _rows(path, table):
            found, _ = rows.get(keys)
            out.append((path, int(found.sum())))
    return out


def erase_from_checkpoints(
    root: Path | None, table: str, keys: npt.NDArray[np.int64], only: Collection[str] | None = None
) -> list[tuple[Path, int]]:
    """Delete the rows of ``keys`` from every checkpoint part under ``root`` (of ``only``, when
    given: paths) that holds ``table``, and compact each part that held some; ``(part, rows
    deleted)`` for each part that holds the table. Raises ``StorageFailed`` when a part cannot
    be written."""
    out = []
    for part in parts_under(root):
        if only is not None and str(part) not in only:
            continue
        held = find_in_checkpoints(part, table, keys, part=True)  # read-only: no lock, nothing written
        if held and held[0][1]:
            held = [(part, _delete_in_part(part, table, keys))]
        out += held
    return out


def _delete_in_part(part: Path, table: str, keys: npt.NDArray[np.int64]) -> int:
    """Delete the rows of ``keys`` from the checkpoint part ``part`` and compact it; the rows
    deleted. Under a root the shards share, another shard may be erasing the same keys from
    it: wait for it (then nothing may be left to delete)."""
    deadline = time.monotonic() + PART_BUSY_S
    while True:
        if not (part / "db").is_dir():  # removed meanwhile: nothing left to delete (and none to make)
            return 0
        try:
            st = Storage(part, shard=-1, num_shards=0)
        except DataDirError as exc:
            if not isinstance(exc, DataDirBusy) or time.monotonic() > deadline:
                raise StorageFailed(f"checkpoint part {part} cannot be rewritten: {exc}") from None
            time.sleep(0.2)
            continue
        with st:
            blob = st.specs().get(table)
            if blob is None:
                return 0
            rows = st.table(table, spec_from_proto(pb.TableSpec.FromString(blob)).row_format)
            found, _ = rows.get(keys)
            n = int(found.sum())
            if n:
                batch = st.batch()
                rows.delete(batch, keys[found])
                st.commit(batch)
                st.flush_memtables()
                st.compact()
            return n
