"""The leader's side of ``Follow``: a training shard's changes as a stream of batches.

``follow_batches(changes, tables, ...)`` yields ``FollowBatch`` messages for one
follower of a training shard (``Shard.follow`` checks the request and calls it). It starts with a snapshot (every row of every table, over as many messages
as the size limit needs) unless the follower's ``(history, version)`` can be
continued from the shard's change log (``ps.replication.changes``); then, each time pushes were
applied, one batch with the current values of every row they changed since the last
batch, and a heartbeat about every ``heartbeat_s`` while nothing changes, so that the
follower knows it is caught up and that the stream is alive.

Values are read when a batch is built (``Table.peek``: nothing is created, counted or
faulted into RAM), so a batch's rows are at least as new as its ``version``; a row
that no longer exists is sent as deleted. A batch larger than the message limit goes
as several messages; only the last one advances the follower's version.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import wire
from ps.replication.changes import ChangeLog
from ps.replication.publish import Publications
from ps.store import precision
from ps.table import Table, spec_to_proto

__all__ = ["follow_batches"]

_OVERHEAD_BYTES = 1 << 16  # specs, table names, field headers


def follow_batches(
    changes: ChangeLog,
    tables: Callable[[], Sequence[Table]],
    history: str,
    version: int,
    active: Callable[[], bool],
    max_message_bytes: int,
    heartbeat_s: float = 0.5,
    lineage: str = "",
    owned: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.bool_]] | None = None,
    num_shards: Callable[[], int] | None = None,
    publications: Publications | None = None,
    quiet_version: Callable[[], int] | None = None,
) -> Iterator[pb.FollowBatch]:
    """The stream a follower at ``(history, version)`` needs, from the change log
    ``changes`` of the tables ``tables()`` returns, until ``active()`` turns false. Every
    message carries ``lineage`` (the leader's: which data its rows are). ``owned(keys)``:
    which keys the leader owns now; a key without a row is sent as deleted only if it
    does (one that moved to another shard in a live reshard stays with the follower
    until the serving shards switch maps); a snapshot's end says ``num_shards()``. With
    ``publications``, the stream reports how far its batches are built and announces each
    publication after the batch that reaches it (``ps.replication.publish``).
    ``quiet_version()``: the log's version at a moment no write is in progress; read before
    and after a snapshot, it tells a snapshot no write touched, which holds the newest
    publication exactly if no write came after it (a serving shard that starts after the
    last publication serves it at once)."""
    batches = _batches(
        changes, tables, history, version, active, max_message_bytes, heartbeat_s, owned, publications, quiet_version
    )
    for batch in batches:
        batch.lineage = lineage
        if batch.snapshot_end and num_shards is not None:
            batch.num_shards = num_shards()
        yield batch


def _batches(
    changes: ChangeLog,
    tables: Callable[[], Sequence[Table]],
    history: str,
    version: int,
    active: Callable[[], bool],
    max_message_bytes: int,
    heartbeat_s: float,
    owned: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.bool_]] | None,
    publications: Publications | None,
    quiet_version: Callable[[], int] | None,
) -> Iterator[pb.FollowBatch]:
    log, limit = changes, max(1 << 16, max_message_bytes - _OVERHEAD_BYTES)
    sent = version if history == log.history and log.holds(version) else None
    stream = publications.open_stream(-1 if sent is None else sent) if publications is not None else 0

    def marker() -> pb.FollowBatch | None:
        """The publication this stream announces now, if any (its batches are built up to ``sent``)."""
        if publications is None or sent is None:
            return None
        publications.built(stream, sent)
        found = publications.marker(stream, sent)
        if found is None:
            return None
        name, exact = found
        return pb.FollowBatch(
            history=log.history, version=sent, leader_version=log.version, published=name, published_exact=exact
        )

    def snapshot() -> Generator[pb.FollowBatch, None, int]:
        """A snapshot; one no write touched is told to ``publications`` (it may be a publication)."""
        if publications is None or quiet_version is None:
            return (yield from _snapshot(log, tables(), limit))
        before = quiet_version()
        version = yield from _snapshot(log, tables(), limit)
        if quiet_version() == before:
            publications.snapshot_at(stream, before)
        return version

    try:
        while active():
            if sent is None:
                sent = yield from snapshot()
                if (mark := marker()) is not None:
                    yield mark
                continue
            version = log.wait(sent, heartbeat_s)
            if version == sent:
                mark = marker()
                yield (
                    mark
                    if mark is not None
                    else pb.FollowBatch(history=log.history, version=sent, leader_version=version)
                )
                continue
            changed = log.since(sent)
            if changed is None:  # the log moved past ``sent`` while this follower was slow
                sent = None
                continue
            version, unix_s, keys = changed
            yield from _delta(log, tables(), version, unix_s, keys, limit, sent, owned)
            sent = version
            if (mark := marker()) is not None:
                yield mark
    finally:
        if publications is not None:
            publications.close_stream(stream)


def _specs(tables: Sequence[Table]) -> list[pb.TableSpec]:
    return [spec_to_proto(t.spec) for t in tables]


def _delta(
    log: ChangeLog,
    tables: Sequence[Table],
    version: int,
    unix_s: float,
    keys: dict[str, npt.NDArray[np.int64]],
    limit: int,
    before: int,
    owned: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.bool_]] | None = None,
) -> Iterator[pb.FollowBatch]:
    """One change batch, split into messages under ``limit`` bytes (only the last one
    carries ``version``; the others keep the follower at ``before``)."""
    history, specs = log.history, _specs(tables)
    by_name = {t.spec.name: t for t in tables}
    parts: list[pb.TableDelta] = []
    size = 0
    for name in sorted(keys):
        table = by_name[name]
        step = max(1, limit // (8 + 4 * table.dim))
        for start in range(0, keys[name].shape[0], step):
            k = keys[name][start : start + step]
            found, rows = table.peek_rows(k)
            gone = k[~found]
            if owned is not None and gone.size:
                gone = gone[owned(gone)]  # keys that moved to another shard are not deleted here
            delta = pb.TableDelta(
                table=name,
                keys=wire.encode_keys(rows.keys),
                rows=precision.travelling(table.spec.storage_dtype, rows.values, rows.state).tobytes(),
                dim=table.dim,
                dtype=_sent_type(table),
                deleted_keys=wire.encode_keys(gone),
            )
            if parts and size + k.shape[0] * (8 + 4 * table.dim) > limit:
                yield pb.FollowBatch(history=history, version=before, leader_version=version, specs=specs, deltas=parts)
                parts, size = [], 0
            parts.append(delta)
            size += k.shape[0] * (8 + 4 * table.dim)
    yield pb.FollowBatch(
        history=history, version=version, leader_version=version, version_unix_s=unix_s, specs=specs, deltas=parts
    )


def _snapshot(log: ChangeLog, tables: Sequence[Table], limit: int) -> Generator[pb.FollowBatch, None, int]:
    """Every row of every table, as current as when each table is read; returns the
    version the follower is at after applying it (read before any row is)."""
    version, unix_s = log.version, time.time()
    specs = _specs(tables)
    yield pb.FollowBatch(
        history=log.history, version=version, leader_version=version, specs=specs, snapshot_begin=True, in_snapshot=True
    )
    for table in tables:
        rows = table.export()
        keys, values = rows.keys, rows.values
        step = max(1, limit // (8 + 4 * table.dim))
        for start in range(0, keys.shape[0], step):
            delta = pb.TableDelta(
                table=table.spec.name,
                keys=wire.encode_keys(keys[start : start + step]),
                rows=precision.travelling(
                    table.spec.storage_dtype, values[start : start + step], rows.state[start : start + step]
                ).tobytes(),
                dim=table.dim,
                dtype=_sent_type(table),
            )
            yield pb.FollowBatch(
                history=log.history, version=version, leader_version=log.version, deltas=[delta], in_snapshot=True
            )
    yield pb.FollowBatch(
        history=log.history,
        version=version,
        leader_version=log.version,
        version_unix_s=unix_s,
        specs=specs,
        snapshot_end=True,
        in_snapshot=True,
    )
    return version


def _sent_type(table: Table) -> pb.DType:
    """The dtype a table's rows travel in: their stored type (8-bit rows go as float32)."""
    kind = table.spec.storage_dtype
    return precision.to_wire(precision.FLOAT32 if kind == precision.INT8 else kind)
