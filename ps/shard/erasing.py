"""Erasing rows for good on one shard (the ``Erase`` RPC, ``ps-admin erase``).

On a training shard an erase deletes the keys' rows from RAM and the data dir and records
the deletion in the change log (the serving shards that follow it delete them too); with
``checkpoints`` it also rewrites every checkpoint part under the shard's checkpoint root
(``ps.durability.erasure``) and every rescue dump of its data dir (``ps.durability.rescue``);
with ``compact`` it then compacts the data dir, so the rows' bytes leave the disk. The
erase is written to the data dir's erase journal before any of it is done and taken out
once all of it is: a shard killed half way completes it at its next start (``resume``),
before it serves.

On a serving shard an erase deletes the rows it still holds of the keys (normally none:
it applied its training shard's deletion from the change stream), also from the followed
rows kept aside while a checkpoint is pinned, loads a pinned checkpoint again (the
training shard rewrote it), and compacts its data dir: the bytes of rows the stream
deleted stay in its files until then. A serving shard that serves a data dir read-only
(``--data-dir`` alone) changes nothing; ``verify`` tells what it still holds.

``verify``: change nothing; count the rows of the keys held in RAM and on disk and, with
``checkpoints``, in each checkpoint part and rescue dump.

A shard is sent the keys it owns and, as ``others``, the rest of the erase: after a reshard
its checkpoints and rescue dumps from before it may hold keys another shard owns now, and
until it has dropped the rows it gave away, so may its data dir. It erases those from its
checkpoints and dumps, and from RAM and the data dir only the rows it gave away in a
committed reshard (``Reshard.given_away``): in any other phase a row of another shard's key
may be one arriving in a copy, which is not its to delete. ``verify`` counts them wherever
they are. Only the keys it owns are checked against its cluster map.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from ps.durability import (
    PendingErase,
    close_erase,
    dumps_of,
    erase_data_done,
    erase_from_checkpoints,
    erase_from_dumps,
    find_in_checkpoints,
    find_in_dumps,
    journal_erase,
    parts_under,
    pending_erasures,
)
from ps.elastic import Reshard
from ps.errors import UnknownTable
from ps.replication import ChangeLog
from ps.rwlock import ReadWriteLock
from ps.shard.roles import Role
from ps.store import Storage, StorageFailed
from ps.table import Table

__all__ = ["Erasing", "ErasingParts"]

log = logging.getLogger(__name__)


@dataclass
class ErasingParts:
    """What an erase touches of its shard. ``dump_places``: where rescue dumps of the data
    dir live (``ps.durability.dump_places``); ``guard``: runs a storage call, noting a
    failure; ``checkpoint_lock``: held while checkpoints are written or rewritten."""

    index: int
    table: Callable[[str], Table]
    storage: Storage | None
    checkpoint_root: Path | None
    dump_places: list[tuple[Path, str]]
    changes: ChangeLog
    reshard: Reshard
    role: Role
    serve_lock: ReadWriteLock
    guard: Callable[..., Any]
    checkpoint_lock: threading.Lock


class Erasing:
    """Erases and verifies on one shard (see the module docstring)."""

    def __init__(self, parts: ErasingParts) -> None:
        self._p = parts

    def verify(self, table: Table, keys: npt.NDArray[np.int64], checkpoints: bool) -> pb.EraseResponse:
        """The rows of ``keys`` ``table`` holds (RAM, disk) and, with ``checkpoints``, each
        checkpoint part and rescue dump holds."""
        p = self._p
        ram, disk = table.holds(keys)
        found: list[tuple[Path, int]] = []
        if checkpoints:
            found = find_in_checkpoints(p.checkpoint_root, table.spec.name, keys)
            if p.storage is not None and not p.storage.read_only:
                found += find_in_dumps(p.storage, p.dump_places, table.spec.name, keys)
        return pb.EraseResponse(
            erased_ram=ram,
            erased_disk=disk,
            version=p.role.version,
            checkpoints=[pb.ErasedCheckpoint(path=str(path), rows=n) for path, n in found],
            verified=True,
        )

    def erase(
        self,
        table: Table,
        keys: npt.NDArray[np.int64],
        others: npt.NDArray[np.int64],
        *,
        compact: bool,
        checkpoints: bool,
    ) -> pb.EraseResponse:
        """Erase ``keys`` of ``table`` (a training shard's, which it owns) and ``others`` (keys
        other shards own) where this shard may hold them: see the module docstring."""
        p = self._p
        name = table.spec.name
        job = None
        # No checkpoint is taken between listing the places the rows may be and deleting them.
        with p.checkpoint_lock if checkpoints else contextlib.nullcontext(), p.reshard.writing():
            p.reshard.check_keys("Erase", [(name, keys)], write=True)
            # Rows of other shards' keys leave RAM and the data dir only where this shard gave them
            # away and has not dropped them yet; elsewhere they may be arriving in a reshard's copy.
            keys = np.union1d(keys, p.reshard.given_away(others))
            others = np.setdiff1d(others, keys)
            if p.storage is not None and keys.shape[0] + others.shape[0]:
                places = self._places() if checkpoints else []
                job = p.guard(
                    journal_erase,
                    p.storage,
                    name,
                    keys,
                    compact=compact,
                    checkpoints=checkpoints,
                    places=places,
                    others=others,
                )
            ram, disk = p.guard(table.erase, keys)
            # Every key, not only those found: a follower holding a copy the leader lost deletes it.
            version = p.changes.record([(name, keys)]) if keys.shape[0] else p.changes.version
        if job is not None:
            job = p.guard(erase_data_done, p.storage, job)
        log.info(
            "erase: %d rows of table %r gone from RAM and the data dir (%d in RAM, %d on disk)%s",
            ram + disk,
            name,
            ram,
            disk,
            "; now the checkpoints and rescue dumps" if checkpoints else "",
        )
        only = set(job.places) if job is not None and job.places is not None else None
        everywhere = np.union1d(keys, others)
        rewritten, compact_s = self._rest(name, everywhere, compact=compact, checkpoints=checkpoints, only=only)
        if job is not None:
            self._close(job)
        return pb.EraseResponse(
            erased_ram=ram,
            erased_disk=disk,
            version=version,
            compacted=bool(compact and p.storage is not None),
            compact_s=compact_s,
            checkpoints=[pb.ErasedCheckpoint(path=str(path), rows=n) for path, n in rewritten],
        )

    def erase_served(self, table: Table, keys: npt.NDArray[np.int64], *, compact: bool) -> pb.EraseResponse:
        """Erase ``keys`` of ``table`` on a serving shard (see the module docstring)."""
        p = self._p
        name = table.spec.name
        source = p.role.source
        writable = p.storage is None or not p.storage.read_only
        ram = disk = 0
        base = source.base_tables if source is not None else None
        if base is not None:  # a checkpoint is served (read-only, loaded again below): the followed rows kept aside
            held = [base[name]] if name in base else []
        else:
            held = [table]
        if writable:
            with p.serve_lock.writing():
                for t in held:
                    r, d = p.guard(t.erase, keys)
                    ram, disk = ram + r, disk + d
        if source is not None and source.pinned is not None:
            source.pin(str(source.pinned))
        compact_s = 0.0
        if compact and writable and p.storage is not None:
            compact_s = self._compact()
        log.info(
            "erase: %d rows of table %r gone from this serving shard (%d in RAM, %d on disk)",
            ram + disk,
            name,
            ram,
            disk,
        )
        return pb.EraseResponse(
            erased_ram=ram,
            erased_disk=disk,
            version=p.role.version,
            compacted=bool(compact and writable and p.storage is not None),
            compact_s=compact_s,
        )

    def resume(self) -> int:
        """Complete every erase the journal holds (one a stop cut short); returns how many it
        completed. Raises ``StorageFailed`` when the rows cannot be erased from the data dir
        (the shard must not serve them); a checkpoint or dump that cannot be rewritten is
        logged, naming it, and its entry kept for the next start (or the next erase of the
        keys) to try again: the rows are gone from what the shard serves."""
        p = self._p
        if p.storage is None or p.storage.read_only:
            return 0
        done = 0
        for job in p.guard(pending_erasures, p.storage):
            done += self._complete(job)
        return done

    def _complete(self, job: PendingErase) -> int:
        p = self._p
        assert p.storage is not None
        ram = disk = 0
        if not job.data_done:
            try:
                table = p.table(job.table)
            except UnknownTable:  # the table is gone from the data dir: no row of it is left there
                pass
            else:
                ram, disk = p.guard(table.erase, job.keys)
            job = p.guard(erase_data_done, p.storage, job)
        try:
            rewritten, _ = self._rest(
                job.table,
                job.everywhere,
                compact=job.compact,
                checkpoints=job.checkpoints,
                only=set(job.places) if job.places is not None else None,
            )
        except StorageFailed as exc:
            log.error(
                "an erase that a stop cut short (%d keys of table %r) is gone from the data dir, but not yet from "
                "every checkpoint and rescue dump: %s. Fix that and start again, or run the same ps-admin erase",
                job.keys.shape[0],
                job.table,
                exc,
            )
            return 0
        p.guard(close_erase, p.storage, job)
        log.warning(
            "completed an erase that a stop cut short (begun %s): %d keys of table %r; %d rows were still in the data "
            "dir, %d in %d checkpoint parts and rescue dumps",
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(job.started_unix_s)),
            job.keys.shape[0],
            job.table,
            ram + disk,
            sum(n for _, n in rewritten),
            len(rewritten),
        )
        return 1

    def _close(self, job: PendingErase) -> None:
        """Take ``job`` out of the journal, and every earlier entry it did all of (an erase that
        failed half way and was sent again): a start would otherwise erase those keys once
        more, and with them rows made since."""
        p = self._p
        assert p.storage is not None
        for other in p.guard(pending_erasures, p.storage):
            covered = (
                other.table == job.table
                and (job.compact or not other.compact)
                and (job.checkpoints or not other.checkpoints)
                and np.isin(other.keys, job.keys).all()
                and np.isin(other.others, job.everywhere).all()
            )
            if other.id == job.id or covered:
                p.guard(close_erase, p.storage, other)

    def _places(self) -> list[Path]:
        """The checkpoint parts and rescue dumps the rows may be in now."""
        p = self._p
        dumps = dumps_of(p.storage, p.dump_places) if p.storage is not None else []
        return [*parts_under(p.checkpoint_root), *dumps]

    def _rest(
        self, name: str, keys: npt.NDArray[np.int64], *, compact: bool, checkpoints: bool, only: set[str] | None
    ) -> tuple[list[tuple[Path, int]], float]:
        """After RAM and the data dir: checkpoints and rescue dumps (of ``only``, when given),
        then compaction. A checkpoint or dump that cannot be rewritten raises ``StorageFailed``
        naming it, without marking the data dir failed (it is not)."""
        p = self._p
        rewritten: list[tuple[Path, int]] = []
        if checkpoints:
            with p.checkpoint_lock:  # not while this shard writes a checkpoint
                rewritten = erase_from_checkpoints(p.checkpoint_root, name, keys, only)
                if p.storage is not None:
                    rewritten += erase_from_dumps(p.storage, p.dump_places, name, keys, only)
        compact_s = self._compact() if compact and p.storage is not None else 0.0
        return rewritten, compact_s

    def _compact(self) -> float:
        p = self._p
        assert p.storage is not None
        t0 = time.perf_counter()
        p.guard(p.storage.flush_memtables)
        p.guard(p.storage.compact)
        return time.perf_counter() - t0
