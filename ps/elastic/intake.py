"""A new owner's side of a reshard: pulling the keys that move here from their old owners.

``Intake`` runs one thread per old owner (``MoveState.sources``). Each opens that
shard's ``MoveRows`` stream (``ps.elastic.moveout``) and applies what comes: tables it does not
hold yet are created with the old owner's spec; rows are installed whole
(``Table.install_rows``: written to the data dir as they come, so the last write, which
pushes to moving keys wait for, holds only the last changes); deleted keys are removed;
each change is recorded in this shard's change log (its own followers see the rows
arrive). A stream that starts a copy first drops what an earlier try brought from that
shard. The last message (``done``) brings the old owner's push ledgers, which each table
keeps apart for the keys that came with them (``TableLedgers.import_moved``), and
admission counters; then everything is made durable (``flush``) and the old owner is
reported complete (``on_complete``), which the shard records in its data dir before it
says so.

If a stream breaks (the old owner restarts, the network fails, this shard's disk refuses
the rows) the thread tries again with backoff, from a new copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from protos import ps_pb2 as pb
from protos import wire
from protos.keys import shard_of
from protos.rpc.backoff import Backoff
from protos.rpc.tls import open_channel
from protos.services import PS_SERVICE
from ps.elastic.cluster import MoveState
from ps.errors import ShardError
from ps.replication import ChangeLog
from ps.store import Rows, StorageClosed, StorageFailed
from ps.table import Table, TableSpec, spec_from_proto
from ps.yielding import lower_this_thread

__all__ = ["Intake", "MoveStream", "SourceProgress", "grpc_identify", "grpc_move_stream"]

log = logging.getLogger(__name__)

MoveStream = Callable[[str, pb.MoveRowsRequest], Iterable[pb.MoveBatch]]
"""Opens the ``MoveRows`` stream of the shard at an address (``ps.service.server`` gives one)."""

_BACKOFF_S = (0.1, 5.0)


class _MoveCall:
    """One ``MoveRows`` call on a channel of its own: iterate it; ``cancel`` ends both."""

    def __init__(self, channel: grpc.Channel, call: Iterable[pb.MoveBatch]) -> None:
        self._channel, self._call = channel, call

    def __iter__(self) -> Iterator[pb.MoveBatch]:
        try:
            yield from self._call
        finally:
            self.cancel()

    def cancel(self) -> None:
        cancel = getattr(self._call, "cancel", None)
        if cancel is not None:
            cancel()
        self._channel.close()


def grpc_move_stream(
    credentials: grpc.ChannelCredentials | None, metadata: tuple[tuple[str, str], ...], max_message_bytes: int
) -> MoveStream:
    """A ``MoveStream`` over gRPC, with this shard's TLS credentials and bearer token for
    its peers (the ``--client-*`` settings, as a follower uses them)."""

    def open_stream(address: str, request: pb.MoveRowsRequest) -> Iterable[pb.MoveBatch]:
        channel = open_channel(address, credentials, [("grpc.max_receive_message_length", max_message_bytes)])
        move_rows = channel.unary_stream(
            f"/{PS_SERVICE}/MoveRows",
            request_serializer=pb.MoveRowsRequest.SerializeToString,
            response_deserializer=pb.MoveBatch.FromString,
        )
        return _MoveCall(channel, move_rows(request, metadata=metadata))

    return open_stream


def grpc_identify(
    credentials: grpc.ChannelCredentials | None, metadata: tuple[tuple[str, str], ...], timeout_s: float = 2.0
) -> Callable[[str], int | None]:
    """``ReshardSettings.identify`` over gRPC: the shard index a ``GetMap`` at the address
    answers with, None when nothing answers within ``timeout_s``."""

    def identify(address: str) -> int | None:
        with open_channel(address, credentials, []) as channel:
            get_map = channel.unary_unary(f"/{PS_SERVICE}/GetMap", None, pb.GetMapResponse.FromString)
            try:
                return int(get_map(pb.GetMapRequest().SerializeToString(), timeout=timeout_s, metadata=metadata).shard)
            except grpc.RpcError:
                return None

    return identify


@dataclass
class SourceProgress:
    """How the copy from one old owner stands (``MoveSource`` in ``Stats``)."""

    shard: int
    address: str
    connected: bool = False
    snapshot_done: bool = False
    complete: bool = False
    rows: int = 0  # every row received: the first copy, then each change after it
    first_copy_rows: int = 0  # the rows of the (last) first copy, each moving row once
    changed_rows: int = 0  # rows received after it: changes to moving rows
    copy_from: int = 0  # ``rows`` when that copy began
    bytes: int = 0
    version: int = 0
    source_version: int = 0
    error: str = ""
    disk_failed: bool = False  # ``error`` is this shard's disk refusing the rows

    def to_proto(self) -> pb.MoveSource:
        return pb.MoveSource(
            shard=self.shard,
            address=self.address,
            connected=self.connected,
            snapshot_done=self.snapshot_done,
            complete=self.complete,
            rows=self.rows,
            first_copy_rows=self.first_copy_rows,
            changed_rows=self.changed_rows,
            bytes=self.bytes,
            lag_versions=max(0, self.source_version - self.version),
            error=self.error,
            disk_failed=self.disk_failed,
        )


class Intake:
    """Pulls the rows of ``move`` that come to this shard (see the module docstring).

    ``tables()`` lists the shard's tables, ``install_table(spec)`` creates one;
    ``flush()`` makes every row and ledger durable; ``on_complete(source)`` records an
    old owner as done (it may raise ``StorageFailed``: the copy is tried again).
    """

    def __init__(
        self,
        move: MoveState,
        *,
        stream: MoveStream,
        tables: Callable[[], list[Table]],
        install_table: Callable[[TableSpec], object],
        changes: ChangeLog,
        flush: Callable[[], object],
        on_complete: Callable[[int], None],
    ) -> None:
        self.move = move
        self._stream = stream
        self._tables, self._install_table = tables, install_table
        self._changes, self._flush, self._on_complete = changes, flush, on_complete
        # A source recorded complete (before a restart) took its first copy and every change after it.
        self.progress = {
            s: SourceProgress(
                s,
                move.src.addresses[s] if s < len(move.src.addresses) else "",
                snapshot_done=s in move.complete,
                complete=s in move.complete,
            )
            for s in move.sources
        }
        self._stop = threading.Event()
        self._calls: dict[int, Iterable[pb.MoveBatch]] = {}  # open streams, to cancel on stop
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for source, progress in self.progress.items():
            if progress.complete:
                continue
            thread = threading.Thread(
                target=self._run, args=(source,), name=f"ps-intake-{self.move.index}-from-{source}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for call in list(self._calls.values()):
            cancel = getattr(call, "cancel", None)
            if callable(cancel):
                cancel()
        for thread in self._threads:
            thread.join(timeout=10)

    @property
    def complete(self) -> bool:
        return all(p.complete for p in self.progress.values())

    def _run(self, source: int) -> None:
        lower_this_thread()  # the copy takes the cores that requests leave idle
        progress = self.progress[source]
        backoff = Backoff(*_BACKOFF_S)
        while not self._stop.is_set() and not progress.complete:
            try:
                self._copy(source, progress)
                backoff.reset()
            except grpc.RpcError as exc:
                progress.error, progress.disk_failed = f"{exc.code().name}: {exc.details()}", False
            except StorageClosed as exc:  # this shard is stopping
                progress.error, progress.disk_failed = str(exc), False
            except StorageFailed as exc:  # this shard's disk: say so apart, the admin gives up on it
                progress.error, progress.disk_failed = str(exc), True
            except (ShardError, wire.WireFormatError, ValueError) as exc:
                progress.error, progress.disk_failed = str(exc), False
            except Exception as exc:  # a bug: keep the shard up, say so, try again
                log.exception("copying rows from shard %d failed", source)
                progress.error, progress.disk_failed = f"{type(exc).__name__}: {exc}", False
            progress.connected = False
            if progress.complete or self._stop.is_set():
                break
            if progress.error:
                log.warning(
                    "reshard: copy from shard %d (%s): %s; trying again", source, progress.address, progress.error
                )
            self._stop.wait(backoff.next_s())

    def _copy(self, source: int, progress: SourceProgress) -> None:
        request = pb.MoveRowsRequest(
            to=self.move.dst.to_proto(), destination=self.move.index, max_rows_per_s=self.move.max_rows_per_s
        )
        call = self._stream(progress.address, request)
        self._calls[source] = call
        try:
            for batch in call:
                if self._stop.is_set():
                    return
                progress.connected, progress.error, progress.disk_failed = True, "", False
                self._apply(source, progress, batch)
                if progress.complete:
                    return
        finally:
            self._calls.pop(source, None)

    def _apply(self, source: int, progress: SourceProgress, batch: pb.MoveBatch) -> None:
        if batch.snapshot_begin:
            dropped = self._drop(source)
            if dropped:
                log.info("reshard: dropped %d rows of an earlier copy from shard %d", dropped, source)
            progress.snapshot_done = False
            progress.copy_from, progress.changed_rows = progress.rows, 0
        for spec in batch.specs:
            self._install_table(spec_from_proto(spec))
        changed = []
        for moved in batch.tables:
            table = self._table(moved.table)
            if table is None:
                raise ShardError(f"rows of table {moved.table!r} came before its spec")
            keys = wire.decode_keys(moved.keys, f"MoveBatch table {moved.table!r} keys")
            rows = Rows.unpack(keys, moved.rows, table.spec.row_format)
            if len(rows):
                table.install_rows(rows)
            deleted = wire.decode_keys(moved.deleted_keys, f"MoveBatch table {moved.table!r} deleted_keys")
            if deleted.size:
                table.remove(deleted)
            changed.append((moved.table, np.concatenate([keys, deleted])))
            progress.rows += len(rows) + int(deleted.size)
            if progress.snapshot_done:
                progress.changed_rows += len(rows) + int(deleted.size)
            progress.bytes += len(moved.rows) + len(moved.keys)
        if changed:
            self._changes.record(changed)
        progress.version, progress.source_version = batch.version, batch.source_version
        if batch.snapshot_end:
            progress.snapshot_done = True
            progress.first_copy_rows = progress.rows - progress.copy_from
            log.info("reshard: first copy from shard %d arrived (%d rows)", source, progress.first_copy_rows)
        if batch.done:
            self._finish(source, progress, batch)

    def _finish(self, source: int, progress: SourceProgress, batch: pb.MoveBatch) -> None:
        entries: dict[str, dict[str, bytes]] = {}
        for ledger in batch.ledgers:
            entries.setdefault(ledger.table, {})[ledger.client_id] = ledger.entry
        for spec in batch.specs:
            table = self._table(spec.name)
            if table is not None:
                table.ledgers.import_moved(source, entries.get(spec.name, {}))
        for admission in batch.admission:
            table = self._table(admission.table)
            if table is not None:
                table.merge_admission(admission.counters)
        t0 = time.monotonic()
        self._flush()  # every row and ledger that came is durable before the old owner may forget them
        self._on_complete(source)
        progress.complete = True
        log.info(
            "reshard: every row from shard %d is here and durable (%d rows, %d changes after, %.0f ms to write)",
            source,
            progress.first_copy_rows,
            progress.changed_rows,
            1000 * (time.monotonic() - t0),
        )

    def _table(self, name: str) -> Table | None:
        return next((t for t in self._tables() if t.spec.name == name), None)

    def _drop(self, source: int) -> int:
        """Remove the rows an earlier copy brought from ``source`` (keys it owned before)."""
        n = self.move.src.num_shards
        dropped = 0
        for table in self._tables():
            gone = table.remove_where(lambda keys: shard_of(keys, n) == source)
            if gone.size:
                self._changes.record([(table.spec.name, gone)])
            dropped += int(gone.size)
        return dropped
