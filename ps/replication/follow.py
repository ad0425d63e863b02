"""Where a serving shard's rows come from: its data dir, a checkpoint, or a training shard it follows.

A serving shard (``ps-server --mode serve``) has one ``Source``:

* ``--data-dir DIR`` alone: the rows in DIR (a data dir or a checkpoint), opened read-only.
* ``--follow ADDR``: the rows of the training shard at ADDR, kept current by its change
  stream (``Follow``, see ``ps.replication.stream``). A thread holds the stream open; each batch is
  applied holding the shard's ``serve_lock`` to write (lookups hold it to read), so a
  lookup sees a batch whole or not at all, and the shard's version only grows: a row never goes back
  to an older value it already served. A snapshot (first start, or when the leader can
  no longer continue this follower's history) is staged whole and then applied at once,
  dropping rows the leader no longer has. With ``--data-dir`` the follower keeps its copy
  there (its own directory, written by it alone): a restarted follower continues from
  the version its data dir holds, which is saved only after the rows of that version
  were written. If the stream breaks, it reconnects with backoff and carries on. The
  follower reports its leader's lineage (``Stats.lineage``: which data the rows are) once
  it applied rows of it; it is saved with the version.

``pin(checkpoint)`` serves a checkpoint instead (read-only; a follower pauses its stream
meanwhile) and ``unpin()`` switches back; ``ps-admin serve-from`` drives both, to roll
serving back to a known-good version and forward again.

Lag: ``lag_versions`` is the newest leader version heard of minus the one applied;
``lag_s`` is how long the follower has been behind (0 when caught up). While a snapshot is
being staged the follower is behind whatever the versions say (a restarted leader counts
its versions from 0 again, in a new history): ``lag_versions`` is then at least 1.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import wire
from protos.keys import shard_of
from protos.rpc.backoff import Backoff
from protos.rpc.tls import open_channel
from ps.durability import read_base, resolve_existing_checkpoint
from ps.errors import InvalidRequest
from ps.replication.gate import PublicationGate
from ps.rwlock import ReadWriteLock
from ps.store import DataDirError, Storage, StorageFailed, precision
from ps.table import Lifecycle, Table, TableSpec, spec_from_proto

__all__ = ["Served", "Source", "held_as"]

log = logging.getLogger(__name__)

# "<history> <version> <lineage or -> <publication>" of the rows this data dir holds
# (older versions wrote the first two or three)
_STATE_KEY = b"follow-state"
_SAVE_EVERY_S = 2.0


class Served(Protocol):
    """What a ``Source`` reads and changes of the serving shard it feeds (``ps.shard.Shard``
    is one): which shard it is, its data dir and checkpoint root, and its tables, which
    the source changes holding ``serve_lock`` to write (lookups hold it to read)."""

    index: int
    lineage: str  # of the shard's own data dir
    storage: Storage | None
    checkpoint_root: Path | None
    serve_lock: ReadWriteLock

    @property
    def num_shards(self) -> int: ...

    def tables(self) -> list[Table]: ...

    def table(self, name: str) -> Table: ...

    def install_table(self, spec: TableSpec, limited: bool = False) -> bool: ...

    def swap_tables(self, tables: dict[str, Table]) -> dict[str, Table]: ...

    def flush(self, metadata: bool = True) -> int: ...


class Source:
    """The source of ``shard``'s rows (see the module docstring). ``leader``: the training
    shard to follow, or None to serve the shard's own tables as they are."""

    def __init__(
        self,
        shard: Served,
        leader: str | None = None,
        *,
        max_message_bytes: int = 64 << 20,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        serve_dtype: str = "stored",
        published_only: bool = False,
    ) -> None:
        self.shard = shard
        self.leader = leader
        # --published-only: changes are staged and applied at the leader's publications
        self.gate = PublicationGate(self) if published_only else None
        self.serve_dtype = serve_dtype  # how tables taken from the leader hold their rows ("stored": as it does)
        self.max_message_bytes = max_message_bytes
        self.credentials, self.metadata = credentials, metadata  # TLS and bearer token for the leader
        self.history, self.applied_version = "", 0
        self.followed_lineage = ""  # the leader's lineage of the rows applied ("": none yet)
        self.leader_version = 0
        self.snapshots = self.batches = 0
        self.connected = False
        self.error = ""
        self.pinned: Path | None = None
        self._pinned_lineage = ""
        self._pinned_storage: Storage | None = None
        self._base: dict[str, Table] | None = None  # the shard's own tables while pinned
        self._behind_since: float | None = None
        self._staged: dict[str, list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]]] = {}
        self._resync_lag = 0  # while a snapshot is staged: versions it brings (all, in a new history)
        self.resyncing = False  # a snapshot is on its way: the rows served are older than the leader's
        self._saved_version = -1
        self._saved_at = 0.0
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._call: Any = None  # the open Follow call (an iterator that can be cancelled)
        self._thread: threading.Thread | None = None
        if leader is None and serve_dtype != "stored":  # a data dir or checkpoint served as it is
            shard.swap_tables({t.spec.name: held_as(t, serve_dtype) for t in shard.tables()})
        if leader is not None and shard.storage is not None:
            saved = shard.storage.get_meta(_STATE_KEY)
            if saved:
                history, version, *rest = saved.decode().split()
                self.history, self.applied_version = history, int(version)
                self.followed_lineage = rest[0] if rest and rest[0] != "-" else ""
                if self.gate is not None and len(rest) > 1:
                    self.gate.publication = rest[1]
                self._saved_version = self.applied_version
                log.info("continuing to follow %s from version %d (history %s)", leader, int(version), history)

    # -- status ----------------------------------------------------------------------------

    @property
    def lineage(self) -> str:
        """Which data the rows served now are (``Stats.lineage``): the pinned checkpoint's,
        the leader's of the rows applied ("" before any), or the shard's own data dir's."""
        if self.pinned is not None:
            return self._pinned_lineage
        return self.followed_lineage if self.leader is not None else self.shard.lineage

    @property
    def base_tables(self) -> dict[str, Table] | None:
        """The shard's own tables, kept aside while a checkpoint is pinned (else None)."""
        return self._base

    @property
    def kind(self) -> str:
        if self.pinned is not None:
            return "checkpoint"
        return "follow" if self.leader is not None else "data-dir"

    def lag_s(self) -> float:
        since = self._behind_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def lag_versions(self) -> int:
        if self.resyncing:
            return max(1, self._resync_lag)  # none of the snapshot's versions is applied yet
        return max(0, self.leader_version - self.applied_version)

    def caught_up(self, max_lag_s: float) -> bool:
        """Whether the rows served are the leader's, at most ``max_lag_s`` behind: the
        stream is open, a snapshot (or the data dir's saved version) is in and no new one
        is being staged."""
        return bool(self.connected and self.history and not self.resyncing and self.lag_s() < max_lag_s)

    def status(self) -> pb.FollowStatus:
        return pb.FollowStatus(
            source=self.kind,
            leader=self.leader or "",
            checkpoint=str(self.pinned or ""),
            connected=self.connected,
            applied_version=self.applied_version,
            leader_version=self.leader_version,
            lag_versions=self.lag_versions(),
            lag_s=self.lag_s(),
            snapshots=self.snapshots,
            batches=self.batches,
            error=self.error if not self.connected else "",
            publication=self.publication,
            publications=self.gate.publications if self.gate is not None else 0,
            staged_batches=self.gate.staged_batches if self.gate is not None else 0,
            published_only=self.gate is not None,
        )

    @property
    def publication(self) -> str:
        """The publication served (``--published-only``; "" before the first, or without)."""
        return self.gate.publication if self.gate is not None and self.pinned is None else ""

    def roll_back(self) -> pb.FollowStatus:
        """Serve the publication before the current one again (``ps.replication.gate``); the
        status after. Raises ``InvalidRequest`` without ``--published-only`` or with none to go back to."""
        if self.gate is None:
            raise InvalidRequest(
                f"RollBack: serving shard {self.shard.index} applies every change of its leader (it was not started "
                "with --published-only): there is no publication to go back to; ps-admin serve-from pins a checkpoint"
            )
        self.gate.roll_back()
        return self.status()

    # -- following -------------------------------------------------------------------------

    def start(self) -> None:
        """Start following (a no-op without a leader)."""
        if self.leader is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"ps-shard{self.shard.index}-follow", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop following and close a pinned checkpoint (blocks until the thread ends)."""
        self._stop.set()
        self._resume.set()
        if self._call is not None:
            self._call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._save_state()
        if self._pinned_storage is not None:
            self._pinned_storage.close()

    def _run(self) -> None:
        assert self.leader is not None
        options = [("grpc.max_receive_message_length", self.max_message_bytes)]
        backoff = Backoff(0.05, 2.0)
        with open_channel(self.leader, self.credentials, options) as channel:
            follow = channel.unary_stream(
                f"/{pb.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/Follow",
                request_serializer=pb.FollowRequest.SerializeToString,
                response_deserializer=pb.FollowBatch.FromString,
            )
            while not self._stop.is_set():
                self._resume.wait()
                if self._stop.is_set():
                    break
                if self.gate is not None:
                    self.gate.reset()  # the leader sends again everything after the version applied
                request = pb.FollowRequest(
                    history=self.history,
                    version=self.applied_version,
                    shard=self.shard.index,
                    num_shards=self.shard.num_shards,
                )
                try:
                    self._call = follow(request, metadata=self.metadata)
                    for batch in self._call:
                        if not self.connected:
                            self.connected = True
                            backoff.reset()
                            log.info("following %s from version %d", self.leader, self.applied_version)
                        self._apply(batch)
                        if not self._resume.is_set() or self._stop.is_set():
                            break
                except grpc.RpcError as exc:
                    if self._stop.is_set() or not self._resume.is_set():
                        continue
                    self._lost(f"{exc.code().name}: {exc.details()}")
                except Exception as exc:  # a bad batch or a storage failure: log, reconnect, carry on
                    log.exception("applying a batch from %s failed", self.leader)
                    self._lost(f"applying a batch failed: {type(exc).__name__}: {exc}")
                finally:
                    if self._call is not None:
                        self._call.cancel()
                    self.connected = False
                self._stop.wait(backoff.next_s())

    def _lost(self, error: str) -> None:
        if self.connected or error != self.error:
            log.warning("lost the change stream of %s: %s (reconnecting)", self.leader, error)
        self.error = error
        if self._behind_since is None:
            self._behind_since = time.monotonic()

    def _apply(self, batch: pb.FollowBatch) -> None:
        """Apply one message of the stream (see the module docstring)."""
        history = self.gate.history if self.gate is not None and self.gate.history else self.history
        if batch.history != history and not batch.in_snapshot:
            raise ValueError(f"a batch of history {batch.history} without a snapshot first")
        if batch.in_snapshot:
            # Until the snapshot is in, the follower is behind. Versions of another history
            # (a restarted leader counts from 0 again) do not compare with the applied one.
            if batch.history == self.history:
                self.leader_version = max(self.leader_version, batch.leader_version)
                self._resync_lag = self.leader_version - self.applied_version
            else:
                self._resync_lag = batch.leader_version
            self.resyncing = True
            if batch.snapshot_begin:
                self._staged = {}
            for d in batch.deltas:
                keys = wire.decode_keys(d.keys, f"table {d.table!r}: keys")
                rows = _delta_rows(d, keys.shape[0])
                self._staged.setdefault(d.table, []).append((keys, rows))
            if batch.snapshot_end:
                if self.gate is not None:
                    self.gate.stage_snapshot(self._staged, batch)
                    self._staged, self.resyncing = {}, False
                else:
                    self._apply_snapshot(batch)
        else:
            self.leader_version = max(self.leader_version, batch.leader_version)
            self.resyncing, self._staged = False, {}  # the leader continued this history after all
            if batch.lineage:
                # One history is one leader process, so the rows applied were of its lineage
                # all along (a state saved by an older version did not say which).
                self.followed_lineage = batch.lineage
            if self.gate is not None:
                self.gate.take(batch)
            elif batch.deltas or batch.version > self.applied_version:
                with self.shard.serve_lock.writing():
                    self.install_delta(batch)
        self._caught_up_check()
        if time.monotonic() - self._saved_at >= _SAVE_EVERY_S:
            self._save_state()

    def install_delta(self, batch: pb.FollowBatch) -> None:
        """Apply one change batch to the tables (the caller holds ``serve_lock`` to write)."""
        self._take_specs(batch.specs)
        for d in batch.deltas:
            table = self.shard.table(d.table)
            keys = wire.decode_keys(d.keys, f"table {d.table!r}: keys")
            table.assign(keys, _delta_rows(d, keys.shape[0]))
            deleted = wire.decode_keys(d.deleted_keys, f"table {d.table!r}: deleted_keys")
            if deleted.size:
                table.remove(deleted)
        self.applied_version = max(self.applied_version, batch.version)
        self.batches += 1

    def _apply_snapshot(self, end: pb.FollowBatch) -> None:
        with self.shard.serve_lock.writing():
            self.install_snapshot(self._staged, end)
        self._staged = {}
        log.info("loaded a snapshot of %s at version %d (history %s)", self.leader, end.version, end.history)
        self._save_state(force=True)

    def install_snapshot(
        self, staged: dict[str, list[tuple[npt.NDArray[np.int64], npt.NDArray[Any]]]], end: pb.FollowBatch
    ) -> None:
        """Replace the tables' rows with a snapshot's (the caller holds ``serve_lock`` to write)."""
        self._take_specs(end.specs)
        for table in self.shard.tables():
            parts = staged.pop(table.spec.name, [])
            keys = np.concatenate([k for k, _ in parts]) if parts else np.empty(0, np.int64)
            held = table.export().keys  # before the snapshot: a new follower's are none, at no cost
            if parts:
                table.assign(keys, np.concatenate([r for _, r in parts]))
            stale = np.setdiff1d(held, keys, assume_unique=True) if held.size else held
            if stale.size and end.num_shards:  # keys that moved away in a reshard stay for now
                stale = stale[shard_of(stale, end.num_shards) == self.shard.index]
            if stale.size:
                table.remove(stale)
        self.history, self.applied_version = end.history, end.version
        self.followed_lineage = end.lineage
        self.leader_version = end.leader_version  # versions of an earlier history do not count
        self.snapshots += 1
        self.resyncing = False

    def _take_specs(self, specs: Iterable[pb.TableSpec]) -> None:
        """Create the leader's tables this shard lacks (lifecycle rules are the leader's to apply),
        holding their rows as ``serve_dtype`` says."""
        have = {t.spec.name for t in self.shard.tables()}
        for msg in specs:
            if msg.name not in have:
                spec = dataclasses.replace(spec_from_proto(msg), lifecycle=Lifecycle())
                if self.serve_dtype != "stored":
                    spec = dataclasses.replace(spec, storage_dtype=self.serve_dtype)
                self.shard.install_table(spec)

    def _caught_up_check(self) -> None:
        if not self.resyncing and self.applied_version >= self.leader_version:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = time.monotonic()

    def save_state(self) -> None:
        """Write the rows applied and the version they reach now (``ps.replication.gate``)."""
        self._save_state(force=True)

    def _save_state(self, force: bool = False) -> None:
        """Write the rows applied so far, then the version they reach (a restart continues there)."""
        storage = self.shard.storage
        if self.leader is None or storage is None or self.pinned is not None:
            return
        if not force and self.applied_version == self._saved_version:
            return
        self._saved_at = time.monotonic()
        with self.shard.serve_lock.reading():
            history, version, lineage = self.history, self.applied_version, self.followed_lineage
            publication = self.publication
        try:
            self.shard.flush()
            storage.put_meta(_STATE_KEY, f"{history} {version} {lineage or '-'} {publication}".strip().encode())
            self._saved_version = version
        except StorageFailed as exc:
            log.warning("could not save the followed rows: %s (retrying later)", exc)

    # -- pinning ---------------------------------------------------------------------------

    def pin(self, checkpoint: str) -> Path:
        """Serve this shard's part of the checkpoint ``checkpoint`` (a name or number under the
        shard's checkpoint root, or an absolute path below it) read-only from now on;
        returns the part's path. Raises ``InvalidRequest`` naming
        the path when it is not a checkpoint of this shard."""
        path = resolve_existing_checkpoint(
            self.shard.checkpoint_root, checkpoint, self.shard.index, self.shard.num_shards
        )
        try:
            storage = Storage(path, shard=self.shard.index, num_shards=self.shard.num_shards, read_only=True)
        except DataDirError as exc:
            raise InvalidRequest(f"checkpoint {checkpoint!r}: {exc}") from None
        tables = {}
        try:
            for name, blob in sorted(storage.specs().items()):
                spec = spec_from_proto(pb.TableSpec.FromString(blob))
                table = Table(spec, rows=storage.table(name, spec.row_format), storage=storage)
                tables[name] = held_as(table, self.serve_dtype)
        except BaseException:
            storage.close()
            raise
        self._resume.clear()  # pause following: the stream loop leaves at its next message
        if self._call is not None:
            self._call.cancel()
        with self.shard.serve_lock.writing():
            previous = self.shard.swap_tables(tables)
            if self._base is None:
                self._base = previous
            old, self._pinned_storage, self.pinned = self._pinned_storage, storage, path
            self._pinned_lineage = read_base(storage).lineage or ""
        if old is not None:
            old.close()
        log.info("serving checkpoint %s (pinned)", path)
        return path

    def serve_from(self, checkpoint: str) -> pb.FollowStatus:
        """``pin(checkpoint)``, or ``unpin()`` for ""; the status after (``Shard.serve_from``)."""
        if checkpoint:
            self.pin(checkpoint)
        else:
            self.unpin()
        return self.status()

    def unpin(self) -> None:
        """Serve the shard's own tables again (a follower resumes its stream where it paused)."""
        if self._base is None:
            return
        with self.shard.serve_lock.writing():
            self.shard.swap_tables(self._base)
            self._base, self.pinned = None, None
            old, self._pinned_storage = self._pinned_storage, None
        if old is not None:
            old.close()
        self._resume.set()
        log.info("unpinned: serving %s again", self.kind)


def held_as(table: Table, kind: str) -> Table:
    """``table`` with its values held as ``kind`` (``--serve-dtype``; "stored": ``table``
    itself, as it is): a copy in RAM alone (the memory budget evicts none of it), taking
    rows out of ``table`` a chunk at a time. An 8-bit copy keeps a scale and a bias per row
    in place of optimizer state; a 16-bit or float32 one keeps the state as initialised.
    ``table`` must not be in service yet (it is read without its lock)."""
    if kind == "stored" or table.spec.storage_dtype == kind:
        return table
    copy = Table(dataclasses.replace(table.spec, storage_dtype=kind, lifecycle=Lifecycle()))
    for rows in table.scan():
        copy.assign(rows.keys, precision.travelling(table.spec.storage_dtype, rows.values, rows.state))
    log.info(
        "table %r: holding %d rows as %s (stored as %s)", table.spec.name, len(copy), kind, table.spec.storage_dtype
    )
    return copy


def _delta_rows(delta: pb.TableDelta, n: int) -> npt.NDArray[Any]:
    """The rows of a change, in the storage type they travel in."""
    kind = precision.from_wire(delta.dtype)
    if kind is None:
        raise ValueError(f"table {delta.table!r}: rows dtype {delta.dtype}: unknown")
    return precision.from_bytes(kind, delta.rows, n, delta.dim, f"table {delta.table!r}: rows")
