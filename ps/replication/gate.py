"""A serving shard that serves publications only (``ps-server --mode serve --published-only``).

Its follower receives the training shard's change stream as any follower does, but
stages every change batch (and a snapshot) instead of applying it. When the stream
announces a publication exactly (``FollowBatch.published``, ``published_exact``; see
``ps.replication.publish``), everything staged is applied at once, under the lock
lookups read under: a lookup sees one publication's rows whole, never a mix, and every
``LookupResponse`` names the publication its rows are of. A publication announced as
not exact (this follower was slow to read the changes) is skipped: the shard keeps
serving the one before and waits for the next.

Before applying a publication the shard keeps what it overwrites (the old rows of the
keys changed, and which keys had none), for the last ``KEEP`` publications:
``roll_back`` restores them and serves the publication before again. The changes undone
stay staged, so the next publication applied brings them back with everything after
it. A publication that arrived as a snapshot (a new follower, a restarted leader)
cannot be undone: the shard keeps no copy of every row.

While publishing is held, staged changes pile up in memory (``FollowStatus.staged_batches``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import wire
from ps.errors import InvalidRequest, UnknownTable
from ps.store import precision

__all__ = ["KEEP", "PublicationGate"]

log = logging.getLogger(__name__)

KEEP = 4  # publications a shard can roll back
I64 = npt.NDArray[np.int64]
Staged = dict[str, list[tuple[I64, npt.NDArray[Any]]]]


class Follower(Protocol):
    """What the gate drives of ``ps.replication.follow.Source``."""

    shard: Any  # ps.replication.follow.Served
    history: str
    applied_version: int

    def install_delta(self, batch: pb.FollowBatch) -> None: ...

    def install_snapshot(self, staged: Staged, end: pb.FollowBatch) -> None: ...

    def save_state(self) -> None: ...


@dataclass(frozen=True)
class _Left:
    """A publication left behind when the next one was applied: how to go back to it."""

    name: str
    version: int
    undo: dict[str, tuple[I64, npt.NDArray[Any], I64]]  # table -> (keys that had rows, those rows, keys that had none)
    redo: list[pb.FollowBatch]  # the batches applied over it, staged again by a roll-back


class PublicationGate:
    """Staged changes and applied publications of one ``--published-only`` follower (see the module)."""

    def __init__(self, follower: Follower) -> None:
        self.follower = follower
        self.publication = ""  # served now ("" before the first)
        self.publications = 0  # applied so far
        self.history = ""  # of the changes staged ("": the follower's own)
        self._snapshot: tuple[Staged, pb.FollowBatch] | None = None
        self._batches: list[pb.FollowBatch] = []
        self._left: deque[_Left] = deque(maxlen=KEEP)
        self._lock = threading.Lock()  # the stream's thread and a RollBack call

    @property
    def staged_batches(self) -> int:
        return len(self._batches) + (self._snapshot is not None)

    def reset(self) -> None:
        """A new stream: the leader sends again everything after the version applied."""
        with self._lock:
            self._snapshot, self._batches, self.history = None, [], ""

    def stage_snapshot(self, staged: Staged, end: pb.FollowBatch) -> None:
        with self._lock:
            self._snapshot, self._batches, self.history = (staged, end), [], end.history

    def take(self, batch: pb.FollowBatch) -> None:
        """Stage one change batch; apply what is staged if it announces a publication exactly."""
        with self._lock:
            if batch.deltas:
                self._batches.append(batch)
            if not batch.published:
                return
            if not batch.published_exact:
                log.warning(
                    "publication %s reached this shard too late to be applied whole (it read its leader's changes "
                    "slowly): still serving %s, waiting for the next",
                    batch.published,
                    self.publication or "nothing published",
                )
                return
            self._apply(batch)

    def _apply(self, marker: pb.FollowBatch) -> None:
        f = self.follower
        with f.shard.serve_lock.writing():
            if self._snapshot is not None:
                f.install_snapshot(*self._snapshot)
                self._left.clear()  # no copy of every row to go back with
            else:
                self._left.append(_Left(self.publication, f.applied_version, self._undo(), self._batches))
            for batch in self._batches:
                f.install_delta(batch)
            f.history, f.applied_version = marker.history, marker.version
            self.publication, self.publications = marker.published, self.publications + 1
            self._snapshot, self._batches, self.history = None, [], ""
        f.save_state()
        log.info("serving publication %s (leader version %d)", marker.published, marker.version)

    def _undo(self) -> dict[str, tuple[I64, npt.NDArray[Any], I64]]:
        """What the staged batches will overwrite, per table (the caller holds the lock to write)."""
        keys: dict[str, list[I64]] = {}
        for batch in self._batches:
            for d in batch.deltas:
                keys.setdefault(d.table, []).append(wire.decode_keys(d.keys, f"table {d.table!r}: keys"))
                keys[d.table].append(wire.decode_keys(d.deleted_keys, f"table {d.table!r}: deleted_keys"))
        undo = {}
        for name, parts in keys.items():
            k = np.unique(np.concatenate(parts).view(np.uint64)).view(np.int64)
            try:
                table = self.follower.shard.table(name)
            except UnknownTable:  # created by these batches: going back removes its rows
                undo[name] = (k[:0], np.empty((0, 0), np.float32), k)
                continue
            found, rows = table.peek_rows(k)
            undo[name] = (k[found], precision.travelling(table.spec.storage_dtype, rows.values, rows.state), k[~found])
        return undo

    def roll_back(self) -> None:
        """Serve the publication before the current one again (see the module)."""
        with self._lock:
            if not self._left or not self._left[-1].name:
                raise InvalidRequest(
                    f"RollBack: this shard serves {self.publication or 'no publication'} and holds none before it to "
                    f"go back to (it keeps the last {KEEP}, and none from before a full copy of its leader)"
                )
            left = self._left.pop()
            f = self.follower
            with f.shard.serve_lock.writing():
                for name, (had, rows, absent) in left.undo.items():
                    table = f.shard.table(name)
                    if had.size:
                        table.assign(had, rows)
                    if absent.size:
                        table.remove(absent)
                gone = self.publication
                f.applied_version, self.publication = left.version, left.name
                self._batches = left.redo + self._batches
            f.save_state()
            log.warning("rolled back from publication %s to %s (by hand)", gone, left.name)
